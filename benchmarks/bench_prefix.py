"""Prefix caching in continuous batching: the same workload with and without it, one model, side by side.

    python benchmarks/bench_prefix.py --model qwen4_exp --layers 40 --workload chat
    python benchmarks/bench_prefix.py --model qwen4_exp --layers 40 --workload shared
    python benchmarks/bench_prefix.py --model inkling --layers 66 --workload chat
    python benchmarks/bench_prefix.py --tiny --device cpu --workload chat      # a smoke run (tests/scripts)

Workloads (random tokens, no eos: each request generates exactly its answer length):

* ``chat``: --conversations conversations of --turns turns; every conversation starts with the same
  --system-tokens system prompt; a turn sends the whole history (system prompt, earlier user messages and
  answers) plus a --user-tokens message and gets an --answer-tokens answer. Conversations arrive at a fixed
  rate (--rate a second; 0: all at once) and a conversation's next turn is sent when its answer is in (closed
  loop per conversation). TTFT is reported over turns 2 and later. (All at once, every conversation's turns
  stay in step with the others' when prefixes are cached, so each turn is 64 requests arriving together and
  TTFT measures that queue; without caching the first turn's long prefill spreads them out.)
* ``shared``: --groups groups of --group-size prompts; the prompts of a group share a --prefix-tokens prefix,
  each adds a --question-tokens question and gets an --answer-tokens answer; all sent at once, or --shared-rate a
  second in group order (all at once, first come first served bounds the TTFT ratio: a request late in the queue
  waits for the prefixes of the groups before it either way).

Each workload runs twice on managers that differ only in ``ContinuousBatchingConfig(allow_block_sharing=...)``,
after the manager's warm-up (`ContinuousBatchingManager.warmup`: kernels, CUDA graphs). Reported per run, as JSON
lines (key ``bench: "prefix"``) appended to ``benchmarks/results/<gpu>.jsonl`` (or --jsonl): TTFT p50 / p99,
output tokens/s, wall time, and with prefix caching its hit rate (tokens restored / tokens looked up), the
snapshots kept, the memory they take, cached blocks and evictions; then a line with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from bench_generate import commit, inkling_config, qwen4_exp_config, results_file
from bench_serving import eager_prefills_counted, graph_recordings
from percentiles import pct


def tiny_config(model: str, layers: int):
    """Small widths for a CPU smoke run (same layer schedules as the bench configs)."""
    if model == "qwen4_exp":
        from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

        return Qwen4ExpTextConfig(
            vocab_size=256, hidden_size=32, num_hidden_layers=layers,
            layer_types=["linear_attention" if (i + 1) % 4 else "indexed_attention" for i in range(layers)],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, hc_count=2, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=16,
            ple_conv_kernel_size=2, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=31,
            make_ngram_vocab_size_divisible_by=8, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16,
            indexer_budget=8, indexer_compress_ratio=2, eos_token_id=1, pad_token_id=0, output_gate_type="sigmoid",
            max_position_embeddings=4096,
        )
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    return InklingTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=layers,
        layer_types=["hybrid" if (i + 1) % 6 == 0 else "hybrid_sliding" for i in range(layers)],
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=6, d_rel=4, rel_extent=12,
        conv_kernel_size=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, eos_token_id=1, pad_token_id=0, max_position_embeddings=4096,
    )


def tokens(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=gen).tolist()


def build_manager(model, args, sharing: bool, max_prompt: int):
    config = ContinuousBatchingConfig(page_size=args.page_size, max_requests_per_batch=args.rows,
                                      max_batch_tokens=args.batch_tokens, num_blocks=args.num_blocks,
                                      allow_block_sharing=sharing)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=args.answer_tokens)
    hints = WorkloadHints(max_prompt_length=max_prompt, max_generated_length=args.answer_tokens, num_requests=args.rows)
    manager = model.init_continuous_batching(gen_config, config, hints, mixed_steps=args.mixed_steps)
    # The kernels of a whole prefill chunk, and decode graphs at every row count beside a row of the workload's
    # longest, before the clock starts (met inside the run they took the first requests' TTFT: 20 s for the first
    # 8,192-token chunk at 40 layers on an H100, then 5 s of graph recordings).
    started = time.perf_counter()
    manager.warmup()
    warmup_s = time.perf_counter() - started
    manager.start()
    return manager, warmup_s


def collect(manager, want: int, on_result, tick=None) -> None:
    """Until ``want`` requests finished; ``tick()`` (if given) runs between results and returns the seconds until
    it must run again (None: not again)."""
    done, wait = 0, 0.0
    while done < want:
        if tick is not None and wait is not None:
            wait = tick()
        result = manager.get_result(timeout=1 if wait is None else max(0.001, min(wait, 1)))
        if result is not None and result.is_finished():
            done += 1
            on_result(result)


def chat(manager, args, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    system = tokens(gen, args.system_tokens, vocab)
    users = [[tokens(gen, args.user_tokens, vocab) for _ in range(args.turns)] for _ in range(args.conversations)]
    history = {c: list(system) for c in range(args.conversations)}
    sent, ttft, turn_of, out_tokens = {}, [], {}, 0

    def send(c: int, turn: int):
        history[c] += users[c][turn]
        rid = manager.add_request(list(history[c]), request_id=f"c{c}t{turn}", max_new_tokens=args.answer_tokens,
                                  record_timestamps=True)
        sent[rid], turn_of[rid] = time.perf_counter(), (c, turn)

    def on_result(result):
        nonlocal out_tokens
        if result.error:
            raise RuntimeError(f"{result.request_id} failed: {result.error}")
        c, turn = turn_of[result.request_id]
        out_tokens += len(result.generated_tokens)
        if turn > 0:
            ttft.append(result.timestamps[0] - sent[result.request_id])
        history[c] += result.generated_tokens
        if turn + 1 < args.turns:
            send(c, turn + 1)

    start = time.perf_counter()
    started = 0

    def arrivals():
        """Starts the conversations due by now (conversation c at c / rate); seconds until the next is due."""
        nonlocal started
        now = time.perf_counter() - start
        while started < args.conversations and (args.rate <= 0 or started / args.rate <= now):
            send(started, 0)
            started += 1
        return None if started == args.conversations else started / args.rate - now

    collect(manager, args.conversations * args.turns, on_result, arrivals)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), "ttft_of": "turns 2 and later"}


def shared(manager, args, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    prompts = []
    for _ in range(args.groups):
        prefix = tokens(gen, args.prefix_tokens, vocab)
        prompts += [prefix + tokens(gen, args.question_tokens, vocab) for _ in range(args.group_size)]
    sent, ttft, out_tokens = {}, [], 0

    def on_result(result):
        nonlocal out_tokens
        if result.error:
            raise RuntimeError(f"{result.request_id} failed: {result.error}")
        out_tokens += len(result.generated_tokens)
        ttft.append(result.timestamps[0] - sent[result.request_id])

    start, rate, started = time.perf_counter(), args.shared_rate, 0

    def arrivals():
        """Sends the prompts due by now (prompt i at i / rate, in group order); seconds until the next is due."""
        nonlocal started
        now = time.perf_counter() - start
        while started < len(prompts) and (rate <= 0 or started / rate <= now):
            rid = manager.add_request(prompts[started], request_id=f"p{started}", max_new_tokens=args.answer_tokens,
                                      record_timestamps=True)
            sent[rid] = time.perf_counter()
            started += 1
        return None if started == len(prompts) else started / rate - now

    collect(manager, len(prompts), on_result, arrivals)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), "ttft_of": "every request",
            "last_sent_s": max(sent.values()) - start}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--workload", choices=["chat", "shared"], default="chat")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--user-tokens", type=int, default=200)
    parser.add_argument("--rate", type=float, default=2.0, help="chat: conversations started a second (0: all at once)")
    parser.add_argument("--shared-rate", type=float, default=0.0,
                        help="shared: prompts sent a second, in group order (0: all at once)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=10)
    parser.add_argument("--prefix-tokens", type=int, default=10240)
    parser.add_argument("--question-tokens", type=int, default=256)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=64, help="requests in flight (max_requests_per_batch)")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="prefill tokens per step")
    parser.add_argument("--page-size", type=int, default=64, help="block size: prefixes are cached in its units")
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--only", choices=["with", "without"], default=None, help="run one side only")
    parser.add_argument("--mixed-steps", action="store_true",
                        help="mixed steps (a short prefill chunk and the decoding rows in one recorded step)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small widths (a CPU smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", default=None)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    if args.model == "qwen4_exp":
        from modeling import Qwen4ExpForCausalLM as Ours
    else:
        from modeling import InklingForCausalLM as Ours
    make = tiny_config if args.tiny else (lambda m, n: qwen4_exp_config(n) if m == "qwen4_exp" else inkling_config(n))
    config = make(args.model, args.layers)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.set_default_dtype(dtype)
    with torch.device(args.device):
        model = Ours(config).eval()
    torch.set_default_dtype(torch.float32)
    vocab = config.vocab_size
    if args.workload == "chat":
        max_prompt = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    else:
        max_prompt = args.prefix_tokens + args.question_tokens
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    jsonl = args.jsonl or results_file(gpu)
    os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)
    common = {"bench": "prefix", "model": args.model, "layers": args.layers, "workload": args.workload,
              "device": gpu, "dtype": str(dtype).replace("torch.", ""), "tiny": args.tiny, "rows": args.rows,
              "page_size": args.page_size, "batch_tokens": args.batch_tokens, "answer_tokens": args.answer_tokens,
              "mixed_steps": args.mixed_steps, "commit": commit()}
    if args.workload == "chat":
        common.update(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                      user_tokens=args.user_tokens, rate=args.rate)
    else:
        common.update(groups=args.groups, group_size=args.group_size, prefix_tokens=args.prefix_tokens,
                      question_tokens=args.question_tokens, rate=args.shared_rate)

    def record(row: dict) -> dict:
        line = {**common, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}}
        print(json.dumps(line), flush=True)
        with open(jsonl, "a") as f:
            f.write(json.dumps(line) + "\n")
        return line

    rows = {}
    sides = [("with", True), ("without", False)]
    for name, sharing in sides:
        if args.only not in (None, name):
            continue
        manager, warmup_s = build_manager(model, args, sharing, max_prompt)
        try:
            recorded = graph_recordings(manager)
            with eager_prefills_counted(manager) as eager:  # (prefill steps that did not replay a graph)
                row = (chat if args.workload == "chat" else shared)(manager, args, vocab)
            row.update(eager_prefill_steps=len(eager), eager_prefill_cells=sum(eager), warmup_s=warmup_s)
            # CUDA graphs recorded inside the measured run (new shapes the warm-up did not see), and the seconds
            # they took: a step that records waits for it.
            row.update({k: v - recorded[k] for k, v in graph_recordings(manager).items()})
            stats = manager.cache.memory_stats()
            if sharing:
                prefix = stats["prefix_cache"]
                row.update(hit_rate=prefix["hit_rate"], hit_tokens=prefix["hit_tokens"],
                           lookup_tokens=prefix["lookup_tokens"], snapshots=prefix["snapshots"],
                           snapshot_bytes=prefix["bytes"], snapshot_gib=prefix["bytes"] / 2**30,
                           cached_blocks=prefix["blocks"], cached_block_gib=prefix["block_bytes"] / 2**30, evictions=prefix["evictions"],
                           snapshot_evictions=prefix["snapshot_evictions"])
            row.update(cache_gib=stats["total_bytes"] / 2**30, prefill_steps=manager.stats["prefill_steps"],
                       decode_steps=manager.stats["decode_steps"], mixed_steps_run=manager.stats["mixed_steps"],
                       preemptions=manager.stats["preemptions"])
            rows[name] = record({"impl": f"{name} prefix caching", **row})
        finally:
            manager.stop(block=True)
            del manager
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    if len(rows) == 2:
        w, wo = rows["with"], rows["without"]
        record({"impl": "ratio", "ttft_p50_lower_x": wo["ttft_p50_s"] / w["ttft_p50_s"] if w["ttft_p50_s"] else None,
                "tokens_per_s_x": w["tokens_per_s"] / wo["tokens_per_s"], "hit_rate": w["hit_rate"],
                "snapshot_gib": w["snapshot_gib"]})
    return rows


if __name__ == "__main__":
    main()
