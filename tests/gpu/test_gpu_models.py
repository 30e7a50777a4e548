"""The CUDA path (Triton kernels and CUDA-graph decode) inside whole models, against upstream transformers.

* fp32, ragged batch, graphs on: every row gives the greedy tokens and (within 1e-3) the logits of upstream
  transformers run on that row alone, unpadded, fp32, on the CPU; and graphed decode equals eager decode (same
  tokens, logits within 5e-5: the graphed step's masked capacity-sized reductions sum in another order). Also
  with 20 rows: graph steps of more than 16 tokens (``batched_mm`` experts in fp32, or the ``tiled_experts``
  kernels where that fusion is on).
* The same with rows longer than the prefill chunk and the attention kernels' key splits (forced small), so
  those loops run several times.
* Greedy (and sampled) decoding of a batch through our loop equals transformers' loop (tokens, cache after).
* bf16 accuracy judged on logits: the same tokens teacher-forced for 32 steps through upstream fp32, upstream
  bf16 and ours bf16 (graphs on), every expert routed (no router flips); our mean logit error against upstream
  fp32 must not exceed 1.5x upstream bf16's own. With 5 rows (graph steps of up to 16 tokens: the fused
  experts) and with 20 (more: ``grouped_mm`` on Hopper or Blackwell).
* Steps with pads on rows that already hold tokens, and continuous batching, against upstream.
* Training (autograd on CUDA runs the torch reference ops) equals upstream fp32 on the CPU, with and without
  activation checkpointing; right-padded generate() gives each row's tokens alone.

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_models.py
    HF_QSA_FUSED=none python -m pytest -m gpu -n 0 tests/gpu/test_gpu_models.py   # with the fused kernels off
"""

from __future__ import annotations

import copy

import pytest
import torch

import helpers.qwen4 as q
import helpers.inkling as ink
from hf_qsa_cache import QSAPagedCache

pytestmark = pytest.mark.gpu

NEW = 12
FORCED = 32
GRAPH_VS_EAGER = 5e-5  # largest logit difference between graphed and eager decoding, fp32

QWEN_ROWS = [29, 7, 18, 33, 25]
QWEN_MANY = [29, 7, 18, 33, 25, 11, 4, 27, 16, 9, 30, 21, 13, 24, 6, 19, 31, 10, 22, 15]
INKLING_ROWS = [9, 3, 14, 6, 21]
INKLING_MANY = [9, 3, 14, 6, 21, 12, 5, 17, 8, 11, 19, 4, 16, 7, 13, 10, 20, 15, 2, 18]


def _qwen_pair(**overrides):
    return q.make_pair(q.tiny_config(**overrides) if overrides else None, seed=0)


def _inkling_pair(**overrides):
    return ink.make_pair(ink.make_config(**overrides))


def _inkling_prompts(lengths, seed=None):
    return [p.tolist() for p in (ink.make_prompts(lengths) if seed is None else ink.make_prompts(lengths, seed=seed))]


PAIRS = {"qwen4_exp": _qwen_pair, "inkling": _inkling_pair}
PROMPTS = {
    ("qwen4_exp", 5): lambda: q.random_prompts(QWEN_ROWS, seed=1),
    ("qwen4_exp", 20): lambda: q.random_prompts(QWEN_MANY, seed=3),
    ("inkling", 5): lambda: _inkling_prompts(INKLING_ROWS),
    ("inkling", 20): lambda: _inkling_prompts(INKLING_MANY, seed=3),
}


def _generate(model, ids, mask, block_size, graphs: bool):
    model.use_cuda_graphs = graphs
    cache = QSAPagedCache(model.config, ids.shape[0], ids.shape[1] + NEW, block_size=block_size)
    out = model.generate(ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache, max_new_tokens=NEW,
                         do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    replayed = sum(1 for r in cache.graph_runners.values() for b in r.buckets.values() if b.graph)
    return out, replayed


def check_rows(upstream, ours_gpu, prompts, block_size):
    """Graphed decode of the left-padded batch: tokens equal upstream per row alone, logits within 1e-3; equal to
    eager decode (tokens, logits within `GRAPH_VS_EAGER`); at least one graph captured."""
    ids, mask = q.left_pad(prompts)
    width = ids.shape[1]
    out, graphs = _generate(ours_gpu, ids, mask, block_size, graphs=True)
    eager, _ = _generate(ours_gpu, ids, mask, block_size, graphs=False)
    assert graphs > 0, "no decode step was captured in a CUDA graph"
    for i, p in enumerate(prompts):
        ref = upstream.generate(torch.as_tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        assert out.sequences[i, width:].cpu().tolist() == ref.sequences[0, len(p):].tolist(), f"row {i} tokens"
        diff = (torch.stack([l[i].cpu() for l in out.logits]) - torch.stack([l[0] for l in ref.logits])).abs().max()
        assert diff.item() < 1e-3, f"row {i}: logits {diff.item():.2e} from upstream"
    # The recorded step reduces over capacity-sized, masked key sets: another fp32 summation order than the eager
    # step, as on the CPU (tests/test_decode_graphs.py, the same bound; the 20-row cases differ there by up to
    # 1.1e-5 with the fusions of 709a039). A capture that replays stale inputs or wrong rows is off by far more.
    assert torch.equal(out.sequences, eager.sequences), "graphed and eager decoding gave other tokens"
    graph_vs_eager = max((a - b).abs().max().item() for a, b in zip(out.logits, eager.logits))
    assert graph_vs_eager < GRAPH_VS_EAGER, f"graphed against eager logits {graph_vs_eager:.2e}"


@pytest.mark.parametrize("model, rows", list(PROMPTS), ids=[f"{m}-{n}rows" for m, n in PROMPTS])
def test_rows_equal_upstream_and_graphs_equal_eager(model, rows):
    upstream, ours = PAIRS[model]()
    check_rows(upstream, copy.deepcopy(ours).cuda(), PROMPTS[model, rows](), block_size=4)


LONG_ROWS = ["qwen4_exp", "qwen4_exp-selection-from-tile-maxima", "inkling"]


@pytest.mark.parametrize("case", LONG_ROWS)
def test_long_rows(case, monkeypatch):
    """Rows longer than the prefill chunk and than the attention kernels' key splits (both forced small here), so
    every chunk and split loop runs several times inside the CUDA path."""
    from hf_qsa_cache.ops import inkling_attention_triton as ink_kernel
    from hf_qsa_cache.ops import qsa, qsa_triton, top_set

    for name in ("MIN_SPLIT_KEYS", "DECODE_BLOCK_N", "PREFILL_BLOCK_N"):
        monkeypatch.setattr(ink_kernel, name, 16)
    # QSA: selections split in tiles of 16 (a split per tile; decode steps too), index scores in token tiles from
    # 2 tokens.
    for name, value in (("ATTENTION_BLOCK_W", 16), ("ATTENTION_DECODE_BLOCK_W", 16), ("MIN_SPLIT_POSITIONS", 1),
                        ("SCORES_PREFILL_TOKENS", 2)):
        monkeypatch.setattr(qsa_triton, name, value)
    if case == "qwen4_exp":
        # Budget 32 (ratio 2): a selection of width 33 spans three 16-position tiles, so decode splits it.
        upstream, ours = q.make_pair(q.tiny_config(indexer_budget=32), seed=4)
        prompts = q.random_prompts([61, 9, 37], seed=5)
    elif case == "qwen4_exp-selection-from-tile-maxima":
        # The long-context selection (tile maxima, then the best tiles' groups scored again), forced on from a
        # few groups with tiles of 2: budget 8 (4 groups) takes it from 16 groups, i.e. 32 positions.
        monkeypatch.setattr(qsa, "SELECT_BY_TILES_MIN_GROUPS", 0)
        monkeypatch.setattr(top_set, "TOPK_TILE", 2)
        upstream, ours = q.make_pair(q.tiny_config(), seed=8)
        prompts = q.random_prompts([61, 9, 37], seed=9)
    else:
        upstream, ours = ink.make_pair(ink.make_config(), seed=6)
        prompts = _inkling_prompts([70, 12, 41], seed=7)
    gpu = copy.deepcopy(ours).cuda()
    gpu.prefill_chunk_tokens = 40  # the 61-token row is prefilled in chunks of 40 // 3 = 13 columns
    check_rows(upstream, gpu, prompts, block_size=4)


LOOP_CASES = {"no-eos": (None, 0, False), "eos-with-headroom": ("ends", 1, False),
              "eos-with-headroom-sampled": ("ends", 1, True)}


@pytest.mark.parametrize("case", list(LOOP_CASES))
@pytest.mark.parametrize("model", list(PAIRS))
@torch.no_grad()
def test_batch_loop_equals_transformers_loop(model, case):
    """Greedy generate() of a ragged batch (graphs on) through our loop (`hf_qsa_cache.decode_loop`) and
    transformers' `_sample`: the same tokens and the same cache after the call (the next step's logits), with no
    end-of-sequence id (nothing read until the end) and with ids that end every row (row i's greedy token i + 2),
    on a cache with a token of rollback headroom (each step's flag read a step late from pinned memory, the extra
    step cropped); then that case sampled (top-k 20) under the same seed in both loops."""
    eos, headroom, sample = LOOP_CASES[case]
    ours_gpu = copy.deepcopy(PAIRS[model]()[1]).cuda()
    ids, mask = (t.cuda() for t in q.left_pad(PROMPTS[model, 5]()))
    ends = None
    if eos is not None:
        ours_gpu.use_cuda_graphs, ours_gpu.lean_decoding = True, True
        cache = QSAPagedCache(ours_gpu.config, ids.shape[0], ids.shape[1] + NEW + 1, block_size=4)
        plain = ours_gpu.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)
        ends = sorted({row[2 + i] for i, row in enumerate(plain[:, ids.shape[1]:].tolist())})
    runs = []
    for lean in (True, False):
        ours_gpu.use_cuda_graphs, ours_gpu.lean_decoding = True, lean
        cache = QSAPagedCache(ours_gpu.config, ids.shape[0], ids.shape[1] + NEW + 1, block_size=4,
                              num_speculative_tokens=headroom)
        torch.manual_seed(0)
        out = ours_gpu.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW,
                                do_sample=sample, pad_token_id=0, eos_token_id=ends, **({"top_k": 20} if sample else {}))
        full = torch.cat([mask, torch.ones(mask.shape[0], out.shape[1] - mask.shape[1], device=mask.device,
                                           dtype=mask.dtype)], dim=1)
        step = ours_gpu(out[:, -1:], attention_mask=full, past_key_values=cache).logits
        runs.append((out, step))
    assert torch.equal(runs[0][0], runs[1][0]), "tokens differ from transformers' loop"
    assert torch.equal(runs[0][1], runs[1][1]), "the next step's logits differ from transformers' loop"


def _teacher_forced_ours(model, prompts, forced, block_size):
    """Our logits ``[rows, FORCED, V]`` for the forced tokens, decoding one step at a time (graphs on)."""
    ids, mask = q.left_pad(prompts)
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


@pytest.mark.parametrize("model, rows", list(PROMPTS), ids=[f"{m}-{n}rows" for m, n in PROMPTS])
def test_bf16_error_within_upstream_bf16(model, rows):
    """bf16 with every expert routed (4 of 4): with top-2 routing a token whose router picks other experts in bf16
    than in fp32 has tens of times the others' error, so over a few tokens the ratio would count such flips
    (benchmarks/bf16_error.py counts them), not rounding."""
    upstream, ours = PAIRS[model](num_experts_per_tok=4)
    prompts = q.random_prompts(QWEN_MANY, seed=2) if (model, rows) == ("qwen4_exp", 20) else PROMPTS[model, rows]()
    if (model, rows) == ("inkling", 20):
        prompts = _inkling_prompts(INKLING_MANY)
    gen = torch.Generator().manual_seed(5)
    forced = torch.randint(2, upstream.config.vocab_size, (len(prompts), FORCED), generator=gen)
    up32 = upstream.float()
    up16 = copy.deepcopy(upstream).to("cuda", torch.bfloat16)
    ours16 = copy.deepcopy(ours).to("cuda", torch.bfloat16)
    mine = _teacher_forced_ours(ours16, prompts, forced, block_size=4)
    err_ours, err_up = [], []
    for i, p in enumerate(prompts):
        ref = _teacher_forced_upstream(up32, p, forced[i], "cpu")
        err_up.append((_teacher_forced_upstream(up16, p, forced[i], "cuda") - ref).abs().mean())
        err_ours.append((mine[i] - ref).abs().mean())
    e_ours, e_up = torch.stack(err_ours).mean().item(), torch.stack(err_up).mean().item()
    assert e_ours <= 1.5 * e_up, (f"mean |logit - upstream fp32| ours {e_ours:.3e}, upstream bf16 {e_up:.3e} "
                                  f"(ratio {e_ours / e_up:.2f}, limit 1.5)")


@pytest.mark.parametrize("model", list(PAIRS))
def test_pads_on_rows_that_hold_tokens(model):
    """Steps where rows that already hold tokens carry pads (a ragged continuation; what continuous batching's
    prefill steps do), on CUDA with the Triton kernels, graphs on: each row's logits equal upstream fp32 on the
    CPU on that row alone; then continuous batching (fp32) equals each prompt alone."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    upstream, ours = PAIRS[model]()
    gpu = copy.deepcopy(ours).cuda()
    upstream.generation_config.eos_token_id = None  # as continuous batching with an unset eos: none
    first = q.random_prompts([12, 21, 7], vocab=90, seed=6)
    second = q.random_prompts([5, 1, 9], vocab=90, seed=7)
    cache = QSAPagedCache(gpu.config, max_batch_size=3, max_cache_len=64, block_size=4)
    ids1, mask1 = q.left_pad(first)
    width = 11
    ids2 = torch.zeros(3, width, dtype=torch.long)
    mask2 = torch.zeros_like(ids2)
    for b, p in enumerate(second):
        ids2[b, width - len(p):], mask2[b, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        gpu(ids1.cuda(), attention_mask=mask1.cuda(), past_key_values=cache)
        logits = gpu(ids2.cuda(), attention_mask=torch.cat([mask1, mask2], 1).cuda(), past_key_values=cache).logits
        for b in range(3):
            expect = upstream(torch.tensor([first[b] + second[b]])).logits[0, -1]
            diff = float((logits[b, -1].cpu() - expect).abs().max())
            assert diff < 1e-3, f"row {b}: logits {diff:.2e} from upstream"
    prompts = q.random_prompts([23, 9, 17, 30, 5, 14], vocab=90, seed=3)
    greedy = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    results = gpu.generate_batch(prompts, greedy, ContinuousBatchingConfig(page_size=4, num_blocks=16,
                                                                           max_batch_tokens=5,
                                                                           max_requests_per_batch=3))
    for i, p in enumerate(prompts):
        alone = upstream.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert results[f"req_{i}"].generated_tokens == alone[0, len(p):].tolist(), f"request {i}"


@pytest.mark.filterwarnings("error:`gradient_checkpointing_.*` is deprecated:FutureWarning")  # 5.23's names only
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("model", list(PAIRS))
def test_training_equals_upstream(model, checkpointing):
    """Training on CUDA (autograd runs the torch reference ops; the Triton kernels have no backward): on a
    right-padded batch, loss and every gradient equal upstream fp32 on the CPU."""
    import test_training as tt

    upstream, ours = PAIRS[model]()
    batch = tt._batch()
    expected_loss, expected = tt._loss_and_grads(upstream, *batch)
    gpu = copy.deepcopy(ours).cuda()
    if checkpointing:
        gpu.activation_checkpointing_enable()  # torch's non-reentrant checkpoint, the default
        assert gpu.is_activation_checkpointing
    loss, grads = tt._loss_and_grads(gpu, *(t.cuda() for t in batch))
    assert grads.keys() == expected.keys()
    assert abs(float(loss) - float(expected_loss)) < 1e-4, f"loss {float(loss):.6f} vs {float(expected_loss):.6f}"
    err = max(float((grads[n].cpu() - g).abs().max() / g.abs().max().clamp_min(1e-6)) for n, g in expected.items())
    assert err < 1e-3, f"worst relative gradient error {err:.2e}"


@pytest.mark.parametrize("model", list(PAIRS))
def test_right_padded_generate_equals_each_row_alone(model):
    import test_training as tt

    upstream, ours = PAIRS[model]()
    gpu = copy.deepcopy(ours).cuda()
    ids, mask, _ = tt._batch()
    out = gpu.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=6, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    for b in range(ids.shape[0]):
        prompt = ids[b, mask[b].bool()]
        alone = upstream.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=6,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out[b, ids.shape[1]:].cpu().tolist() == alone[0, len(prompt):].tolist(), f"row {b}"
