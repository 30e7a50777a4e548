"""Correctness of the CUDA path (Triton kernels and CUDA-graph decode inside whole models).

1. fp32, ragged batch, graphs on: every row gives the greedy tokens and (within 1e-3) the logits of
   upstream transformers run on that row alone, unpadded, fp32, on the CPU; and graphed decode
   equals eager decode (same tokens, logits within 5e-5: the graphed step's masked capacity-sized reductions
   sum in another order).
   Also with 20 rows: graph steps of more than 16 tokens (``batched_mm`` experts in fp32, or the
   ``tiled_experts`` kernels where that fusion is on).
2. The same with rows longer than the prefill chunk and the attention kernels' key splits (forced
   small), so those loops run several times.
3. Plain greedy decoding of a batch through our loop equals transformers' loop (tokens, cache after).
4. Training (autograd on CUDA runs the torch reference ops) equals upstream fp32 on the CPU, with and
   without activation checkpointing; right-padded generate() gives each row's tokens alone.
5. bf16 accuracy judged on logits: the same tokens are teacher-forced for 32 steps through upstream
   fp32, upstream bf16 and ours bf16 (graphs on), every expert routed (no router flips); our mean logit
   error against upstream fp32 must not exceed 1.5x upstream bf16's own. Once with 5 rows (graph steps
   of up to 16 tokens: the fused experts) and once with 20 (more: ``grouped_mm`` on Hopper or Blackwell).

    python benchmarks/gpu_checks.py
    HF_QSA_FUSED=none python benchmarks/gpu_checks.py   # the same checks with the fused kernels off
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from hf_qsa_cache import QSAPagedCache  # noqa: E402

NEW = 12
FORCED = 32
GRAPH_VS_EAGER = 5e-5  # largest logit difference between graphed and eager decoding, fp32


def _generate(model, ids, mask, block_size, graphs: bool):
    model.use_cuda_graphs = graphs
    cache = QSAPagedCache(model.config, ids.shape[0], ids.shape[1] + NEW, block_size=block_size)
    out = model.generate(ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache, max_new_tokens=NEW,
                         do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    replayed = sum(1 for r in cache.graph_runners.values() for b in r.buckets.values() if b.graph)
    return out, replayed


def check_rows(name, upstream, ours_gpu, prompts, block_size):
    from qwen4_helpers import left_pad

    ids, mask = left_pad(prompts)
    width = ids.shape[1]
    out, graphs = _generate(ours_gpu, ids, mask, block_size, graphs=True)
    eager, _ = _generate(ours_gpu, ids, mask, block_size, graphs=False)
    worst, ok = 0.0, graphs > 0
    for i, p in enumerate(prompts):
        ref = upstream.generate(torch.as_tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        same = out.sequences[i, width:].cpu().tolist() == ref.sequences[0, len(p):].tolist()
        diff = (torch.stack([l[i].cpu() for l in out.logits]) - torch.stack([l[0] for l in ref.logits])).abs().max()
        worst = max(worst, diff.item())
        ok &= same and diff.item() < 1e-3
    graph_vs_eager = max((a - b).abs().max().item() for a, b in zip(out.logits, eager.logits))
    same_eager = torch.equal(out.sequences, eager.sequences)
    # The recorded step reduces over capacity-sized, masked key sets: another fp32 summation order than the eager
    # step, as on the CPU (tests/test_decode_graphs.py, the same bound; this check's 20 rows differ there by up to
    # 1.1e-5 with the fusions of 709a039). A capture that replays stale inputs or wrong rows is off by far more.
    ok &= same_eager and graph_vs_eager < GRAPH_VS_EAGER
    print(f"{name}: rows {len(prompts)}, {graphs} graph(s) captured; tokens equal upstream and logits within 1e-3: "
          f"max diff {worst:.2e}; graphed vs eager: tokens equal {same_eager}, max logit diff {graph_vs_eager:.2e} "
          f"-> {'ok' if ok else 'FAILED'}")
    return ok


@torch.no_grad()
def check_batch_loop(name, ours_gpu, prompts, block_size):
    """Greedy generate() of a ragged batch (graphs on) through our loop (`hf_qsa_cache.decode_loop`) and
    transformers' `_sample`: the same tokens and the same cache after the call (the next step's logits), with no
    end-of-sequence id (nothing read until the end) and with ids that end every row, on a cache with a token of
    rollback headroom (each step's flag read a step late from pinned memory, the extra step cropped); then the
    last case sampled (top-k 20) under the same seed in both loops."""
    from qwen4_helpers import left_pad

    ids, mask = (t.cuda() for t in left_pad(prompts))
    plain = None
    ok = True
    for eos, headroom, sample in ((None, 0, False), ("ends", 1, False), ("ends", 1, True)):
        runs = []
        for lean in (True, False):
            ours_gpu.use_cuda_graphs, ours_gpu.lean_decoding = True, lean
            cache = QSAPagedCache(ours_gpu.config, ids.shape[0], ids.shape[1] + NEW + 1, block_size=block_size,
                                  num_speculative_tokens=headroom)
            new_rows = [] if eos is None else plain[:, ids.shape[1]:].tolist()
            ends = sorted({row[2 + i] for i, row in enumerate(new_rows)}) or None  # row i's token i + 2
            torch.manual_seed(0)
            out = ours_gpu.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW,
                                    do_sample=sample, pad_token_id=0, eos_token_id=ends, **({"top_k": 20} if sample else {}))
            full = torch.cat([mask, torch.ones(mask.shape[0], out.shape[1] - mask.shape[1], device=mask.device,
                                               dtype=mask.dtype)], dim=1)
            step = ours_gpu(out[:, -1:], attention_mask=full, past_key_values=cache).logits
            runs.append((out, step))
        plain = runs[0][0] if plain is None else plain
        same = torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
        print(f"{name} batch loop (eos {eos}, headroom {headroom}, sampled {sample}): {tuple(runs[0][0].shape)} tokens and next "
              f"logits equal transformers' loop: {same} -> {'ok' if same else 'FAILED'}")
        ok &= same
    ours_gpu.lean_decoding = True
    return ok


def _teacher_forced_ours(model, prompts, forced, block_size):
    """Our logits ``[rows, FORCED, V]`` for the forced tokens, decoding one step at a time (graphs on)."""
    from qwen4_helpers import left_pad

    ids, mask = left_pad(prompts)
    ids, mask = ids.cuda(), mask.cuda()
    cache = QSAPagedCache(model.config, ids.shape[0], ids.shape[1] + FORCED, block_size=block_size)
    model.use_cuda_graphs = True
    steps = []
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1).logits
        steps.append(logits[:, -1])
        for t in range(FORCED - 1):
            tok = forced[:, t:t + 1].cuda()
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            steps.append(model(tok, attention_mask=mask, past_key_values=cache).logits[:, -1])
    return torch.stack(steps, dim=1).float().cpu()


def _teacher_forced_upstream(model, prompt, forced_row, device):
    seq = torch.as_tensor([list(prompt) + forced_row[: FORCED - 1].tolist()], device=device)
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1:]
    return logits.float().cpu()


def check_bf16(name, upstream, ours, prompts, block_size):
    gen = torch.Generator().manual_seed(5)
    forced = torch.randint(2, upstream.config.vocab_size, (len(prompts), FORCED), generator=gen)
    up32 = upstream.float()
    up16 = copy.deepcopy(upstream).to("cuda", torch.bfloat16)
    ours16 = copy.deepcopy(ours).to("cuda", torch.bfloat16)
    mine = _teacher_forced_ours(ours16, prompts, forced, block_size)
    err_ours, err_up = [], []
    for i, p in enumerate(prompts):
        ref = _teacher_forced_upstream(up32, p, forced[i], "cpu")
        err_up.append((_teacher_forced_upstream(up16, p, forced[i], "cuda") - ref).abs().mean())
        err_ours.append((mine[i] - ref).abs().mean())
    e_ours, e_up = torch.stack(err_ours).mean().item(), torch.stack(err_up).mean().item()
    ok = e_ours <= 1.5 * e_up
    print(f"{name} bf16, {FORCED} teacher-forced steps, rows {len(prompts)}: mean |logit - upstream fp32| ours "
          f"{e_ours:.3e}, upstream bf16 {e_up:.3e} (ratio {e_ours / e_up:.2f}, limit 1.5) -> {'ok' if ok else 'FAILED'}")
    return ok


def check_long_rows():
    """Rows longer than the prefill chunk and than the attention kernels' key splits (both forced small
    here), so every chunk and split loop runs several times inside the CUDA path."""
    import qwen4_helpers as q
    import test_inkling as ink

    from hf_qsa_cache.ops import inkling_attention_triton as ink_kernel
    from hf_qsa_cache.ops import qsa_triton

    saved = ink_kernel.MIN_SPLIT_KEYS, ink_kernel.DECODE_BLOCK_N, ink_kernel.PREFILL_BLOCK_N
    ink_kernel.MIN_SPLIT_KEYS, ink_kernel.DECODE_BLOCK_N, ink_kernel.PREFILL_BLOCK_N = 16, 16, 16
    # QSA: selections split in tiles of 16 (a split per tile; decode steps too), index scores in token tiles from
    # 2 tokens.
    saved_qsa = (qsa_triton.ATTENTION_BLOCK_W, qsa_triton.ATTENTION_DECODE_BLOCK_W, qsa_triton.MIN_SPLIT_POSITIONS,
                 qsa_triton.SCORES_PREFILL_TOKENS)
    (qsa_triton.ATTENTION_BLOCK_W, qsa_triton.ATTENTION_DECODE_BLOCK_W, qsa_triton.MIN_SPLIT_POSITIONS,
     qsa_triton.SCORES_PREFILL_TOKENS) = 16, 16, 1, 2
    ok = True
    try:
        # Budget 32 (ratio 2): a selection of width 33 spans three 16-position tiles, so decode splits it.
        upstream, ours = q.make_pair(q.tiny_config(indexer_budget=32), seed=4)
        gpu = copy.deepcopy(ours).cuda()
        gpu.prefill_chunk_tokens = 40  # the 61-token row is prefilled in chunks of 40 // 3 = 13 columns
        ok &= check_rows("qwen4_exp long rows", upstream, gpu, q.random_prompts([61, 9, 37], seed=5), block_size=4)
        # The long-context selection (tile maxima, then the best tiles' groups scored again), forced on from a
        # few groups with tiles of 2: budget 8 (4 groups) takes it from 16 groups, i.e. 32 positions.
        from hf_qsa_cache.ops import qsa, top_set

        saved_select = qsa.SELECT_BY_TILES_MIN_GROUPS, top_set.TOPK_TILE
        qsa.SELECT_BY_TILES_MIN_GROUPS, top_set.TOPK_TILE = 0, 2
        try:
            upstream, ours = q.make_pair(q.tiny_config(), seed=8)
            gpu = copy.deepcopy(ours).cuda()
            gpu.prefill_chunk_tokens = 40
            ok &= check_rows("qwen4_exp long rows, selection from tile maxima", upstream, gpu,
                             q.random_prompts([61, 9, 37], seed=9), block_size=4)
        finally:
            qsa.SELECT_BY_TILES_MIN_GROUPS, top_set.TOPK_TILE = saved_select
        upstream, ours = ink.make_pair(ink.make_config(), seed=6)
        gpu = copy.deepcopy(ours).cuda()
        gpu.prefill_chunk_tokens = 40
        prompts = [p.tolist() for p in ink.make_prompts([70, 12, 41], seed=7)]
        ok &= check_rows("inkling long rows", upstream, gpu, prompts, block_size=4)
    finally:
        ink_kernel.MIN_SPLIT_KEYS, ink_kernel.DECODE_BLOCK_N, ink_kernel.PREFILL_BLOCK_N = saved
        (qsa_triton.ATTENTION_BLOCK_W, qsa_triton.ATTENTION_DECODE_BLOCK_W, qsa_triton.MIN_SPLIT_POSITIONS,
         qsa_triton.SCORES_PREFILL_TOKENS) = saved_qsa
    return ok


def check_training(name, upstream, ours):
    """Training on CUDA (autograd runs the torch reference ops; the Triton kernels have no backward): on a
    right-padded batch, loss and every gradient equal upstream fp32 on the CPU, with and without
    activation checkpointing; and right-padded generate() (graphs on) gives each row's tokens alone."""
    import test_training as tt

    batch = tt._batch()
    expected = tt._loss_and_grads(upstream, *batch)
    ok = True
    for checkpointing in (False, True):
        model = copy.deepcopy(ours).cuda()
        if checkpointing:
            model.gradient_checkpointing_enable()
        loss, grads = tt._loss_and_grads(model, *(t.cuda() for t in batch))
        err = max(float((grads[n].cpu() - g).abs().max() / g.abs().max().clamp_min(1e-6)) for n, g in expected[1].items())
        same = grads.keys() == expected[1].keys() and abs(float(loss) - float(expected[0])) < 1e-4 and err < 1e-3
        print(f"{name} training on CUDA (checkpointing {checkpointing}): loss {float(loss):.6f} vs upstream "
              f"{float(expected[0]):.6f}, worst relative gradient error {err:.2e}: {'ok' if same else 'FAILED'}")
        ok &= same
    model = copy.deepcopy(ours).cuda()
    ids, mask, _ = batch
    out = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=6, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    for b in range(ids.shape[0]):
        prompt = ids[b, mask[b].bool()]
        alone = upstream.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=6,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)
        same = out[b, ids.shape[1]:].cpu().tolist() == alone[0, len(prompt):].tolist()
        ok &= same
    print(f"{name} right-padded generate on CUDA equals each row alone: {'ok' if ok else 'FAILED'}")
    return ok


def check_pads_on_held_rows(name, upstream, ours):
    """Steps where rows that already hold tokens carry pads (a ragged continuation; what continuous batching's
    prefill steps do), on CUDA with the Triton kernels, graphs on: each row's logits equal upstream fp32 on the
    CPU on that row alone; then continuous batching (fp32) equals each prompt alone."""
    import qwen4_helpers as q
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = copy.deepcopy(ours).cuda()
    upstream.generation_config.eos_token_id = None  # as continuous batching with an unset eos: none
    first = q.random_prompts([12, 21, 7], vocab=90, seed=6)
    second = q.random_prompts([5, 1, 9], vocab=90, seed=7)
    cache = QSAPagedCache(model.config, max_batch_size=3, max_cache_len=64, block_size=4)
    ids1, mask1 = q.left_pad(first)
    width = 11
    ids2 = torch.zeros(3, width, dtype=torch.long)
    mask2 = torch.zeros_like(ids2)
    for b, p in enumerate(second):
        ids2[b, width - len(p):], mask2[b, width - len(p):] = torch.tensor(p), 1
    worst = 0.0
    with torch.no_grad():
        model(ids1.cuda(), attention_mask=mask1.cuda(), past_key_values=cache)
        logits = model(ids2.cuda(), attention_mask=torch.cat([mask1, mask2], 1).cuda(), past_key_values=cache).logits
        for b in range(3):
            expect = upstream(torch.tensor([first[b] + second[b]])).logits[0, -1]
            worst = max(worst, float((logits[b, -1].cpu() - expect).abs().max()))
    ok = worst < 1e-3
    prompts = q.random_prompts([23, 9, 17, 30, 5, 14], vocab=90, seed=3)
    greedy = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    results = model.generate_batch(prompts, greedy, ContinuousBatchingConfig(page_size=4, num_blocks=16,
                                                                             max_batch_tokens=5, max_requests_per_batch=3))
    same = True
    for i, p in enumerate(prompts):
        alone = upstream.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        same &= results[f"req_{i}"].generated_tokens == alone[0, len(p):].tolist()
    print(f"{name} pads on rows that hold tokens (CUDA): max logit diff {worst:.2e}; continuous batching equals each "
          f"prompt alone: {same} -> {'ok' if ok and same else 'FAILED'}")
    return ok and same


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = []

    import qwen4_helpers as q
    import test_inkling as ink

    if os.environ.get("GPU_CHECKS_ONLY_PADS"):  # just the checks of steps with pads on held rows
        ok = [check_pads_on_held_rows("qwen4_exp", *q.make_pair(seed=0)),
              check_pads_on_held_rows("inkling", *ink.make_pair(ink.make_config()))]
        sys.exit(0 if all(ok) else 1)

    upstream, ours = q.make_pair(seed=0)
    prompts = q.random_prompts([29, 7, 18, 33, 25], seed=1)
    results.append(check_rows("qwen4_exp", upstream, copy.deepcopy(ours).cuda(), prompts, block_size=4))
    results.append(check_batch_loop("qwen4_exp", copy.deepcopy(ours).cuda(), prompts, block_size=4))
    # Graph steps of more than 16 tokens (batched_mm in fp32, or the tiled experts where on).
    many = q.random_prompts([29, 7, 18, 33, 25, 11, 4, 27, 16, 9, 30, 21, 13, 24, 6, 19, 31, 10, 22, 15], seed=3)
    results.append(check_rows("qwen4_exp, 20 rows", upstream, copy.deepcopy(ours).cuda(), many, block_size=4))
    # bf16 with every expert routed: with top-2 routing a token whose router picks other experts in bf16 than in
    # fp32 has tens of times the others' error, so over a few tokens the ratio would count such flips
    # (benchmarks/bf16_error.py counts them), not rounding.
    results.append(check_bf16("qwen4_exp", *q.make_pair(q.tiny_config(num_experts_per_tok=4), seed=0), prompts,
                              block_size=4))
    results.append(check_bf16("qwen4_exp", *q.make_pair(q.tiny_config(num_experts_per_tok=4), seed=0),
                              q.random_prompts([29, 7, 18, 33, 25, 11, 4, 27, 16, 9, 30, 21, 13, 24, 6, 19, 31, 10, 22, 15], seed=2), block_size=4))

    upstream, ours = ink.make_pair(ink.make_config())
    prompts = [p.tolist() for p in ink.make_prompts([9, 3, 14, 6, 21])]
    results.append(check_rows("inkling", upstream, copy.deepcopy(ours).cuda(), prompts, block_size=4))
    results.append(check_batch_loop("inkling", copy.deepcopy(ours).cuda(), prompts, block_size=4))
    many = [p.tolist() for p in ink.make_prompts([9, 3, 14, 6, 21, 12, 5, 17, 8, 11, 19, 4, 16, 7, 13, 10, 20, 15, 2, 18],
                                                 seed=3)]
    results.append(check_rows("inkling, 20 rows", upstream, copy.deepcopy(ours).cuda(), many, block_size=4))
    results.append(check_bf16("inkling", *ink.make_pair(ink.make_config(num_experts_per_tok=4)), prompts,
                              block_size=4))
    results.append(check_bf16("inkling", *ink.make_pair(ink.make_config(num_experts_per_tok=4)),
                              [p.tolist() for p in ink.make_prompts([9, 3, 14, 6, 21, 12, 5, 17, 8, 11, 19, 4, 16, 7, 13, 10, 20, 15, 2, 18])],
                              block_size=4))
    results.append(check_long_rows())
    results.append(check_pads_on_held_rows("qwen4_exp", *q.make_pair(seed=0)))
    results.append(check_pads_on_held_rows("inkling", *ink.make_pair(ink.make_config())))
    results.append(check_training("qwen4_exp", *q.make_pair(seed=0)))
    results.append(check_training("inkling", *ink.make_pair(ink.make_config())))
    print("ALL GPU CHECKS PASSED" if all(results) else "GPU CHECK FAILED")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
