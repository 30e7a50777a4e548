"""Upstream transformers vs hf-qsa-cache, side by side in one run, same random weights, bf16, one GPU.

    python benchmarks/bench_generate.py --model qwen4_exp --layers 8 --cases 1x16384 8x4096
    python benchmarks/bench_generate.py --model qwen4_exp --layers 40 --cases 1x4096 8x1024
    python benchmarks/bench_generate.py --model inkling --layers 6 --cases 1x16384 8x4096 32x2048
    python benchmarks/bench_generate.py --model qwen4_exp --layers 40 --cases 1x131072 1x1048576 \
        --graphs on --upstream-limit 60        # long context
    python benchmarks/bench_generate.py --model qwen4_exp --layers 40 --cases 1x4096 --graphs on \
        --skip-upstream --cache-len 1048576    # a short prompt on a cache sized for 1M tokens

For each (batch x prompt length): prefill seconds, decode ms/step (median step) and peak GPU memory
of upstream (`transformers.<Model>ForCausalLM`, its DynamicCache) and of ours (`modeling.<Model>`
on `QSAPagedCache`) with CUDA-graph decode on and off. Every measurement is appended as one JSON
line to ``benchmarks/results/h200.jsonl`` (``h100.jsonl`` on an H100; keys: model, layers, impl, graphs, batch,
prompt_len, new_tokens, prefill_s, decode_ms_per_step, peak_gib, commit, gpu (the device's name; older lines
have none and ran on an H200), fused (the fusions on,
`hf_qsa_cache.fusions.active`; older lines hold the HF_QSA_FUSED setting, where "" meant none), plus
status / floor_ms where known (with floor_lookup_rows: the lookup tables counted by the rows a step
reads; lines without it counted them whole, see `benchmarks/floors.py`); ours adds loop (the decode
loop timed: "ours" unless ``--loops`` says otherwise), cache_gib, store_gib (bytes per cache store) and
prefill_peak_share: model FLOPs of the prefill per second over the H200's dense bf16 peak;
decode_ms_end_to_end where the prefill is short: a step's cost in a plain generate() call with no
per-step stopping criterion (`decode_ms_end_to_end`; from sampled calls, and end_to_end_sampled, with
``--sample``), where decode_ms_per_step times each step with one;
with graphs, graph_kernels / graph_copies launched by one replayed decode step and gpu_busy_share, the
share of a step's wall time the GPU is busy, graph_top_kernels (name, launches, microseconds) and, with
``pdl`` on and a short prefill, graph_top_kernels_without_pdl from a step captured without it: under early
launch a kernel's profiled time holds its wait for the kernel before). Upstream under ``--upstream-limit`` is stopped during its
prefill too and reported as "did not finish in N s" (or "out of memory").

The floor of a decode step is the bytes it must read (the weights a step touches: everything but
the experts and the lookup tables, plus the experts the batch is expected to route to and the rows its
tokens look up in the token and n-gram embeddings; and the cached state the step
reads: GatedDeltaNet state read and written, QSA compressed keys and selected K/V, Inkling window and
full K/V) divided by the copy bandwidth measured in the same run. Layer schedules and per-layer
shapes are listed in benchmarks/RESULTS.md ("Benchmark shapes").
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import signal
import statistics
import subprocess
import time

import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_qsa_cache import QSAPagedCache, fusions
from hf_qsa_cache.ops import triton_common

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200.jsonl")


def results_file(gpu: str) -> str:
    """Where a run on ``gpu`` (its CUDA name) appends its lines by default: ``results/h200.jsonl``, or
    ``results/h100.jsonl`` on an H100 (its bandwidth, so its floor and times, differ)."""
    return RESULTS.replace("h200.jsonl", "h100.jsonl") if "H100" in gpu else RESULTS


def qwen4_exp_config(layers: int):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    # Every fourth layer is QSA: 8 layers = 6 GatedDeltaNet + 2 QSA; 40 = 30 + 10 (the released schedule).
    return Qwen4ExpTextConfig(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=layers,
        layer_types=["linear_attention" if (i + 1) % 4 else "indexed_attention" for i in range(layers)],
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=64, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        hc_count=4, hc_lowrank=320, ple_layer_ids=[2], ngram_vocab_size_base=100_003,
        indexer_n_heads=32, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
        indexer_compress_ratio=4, eos_token_id=1, pad_token_id=0, output_gate_type="sigmoid",
        max_position_embeddings=1 << 21,
    )


def inkling_config(layers: int):
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    # Every sixth layer is full attention: 6 layers = 5 sliding + 1 full; 66 = 55 + 11 (the released schedule).
    return InklingTextConfig(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=layers,
        layer_types=["hybrid" if (i + 1) % 6 == 0 else "hybrid_sliding" for i in range(layers)],
        num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        swa_num_attention_heads=16, swa_num_key_value_heads=4, swa_head_dim=128,
        sliding_window_size=512, d_rel=16, rel_extent=1024, n_routed_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=512, intermediate_size=2048, conv_kernel_size=4, eos_token_id=1, pad_token_id=0,
        max_position_embeddings=1 << 21,
    )


class TimeLimit(Exception):
    pass


def _stop_now(signum, frame):
    raise TimeLimit


class StepTimer(StoppingCriteria):
    """Called once per generated token: the first call marks the end of prefill. Stops every row once
    ``limit_s`` has passed since the start (upstream's time limit)."""

    def __init__(self, start: float, limit_s: float | None):
        self.start, self.limit_s = start, limit_s
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        stop = self.limit_s is not None and self.times[-1] - self.start > self.limit_s
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def run(model, ids, mask, new_tokens, cache=None, limit_s=None) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    timer = StepTimer(start, limit_s)
    if limit_s is not None:
        # The stopping criterion only runs between tokens; a prefill (upstream's indexer is a Python loop)
        # is stopped by an alarm a little after the limit, which leaves room for the decode steps.
        signal.signal(signal.SIGALRM, _stop_now)
        signal.setitimer(signal.ITIMER_REAL, limit_s + 30)
    try:
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None,
                             stopping_criteria=StoppingCriteriaList([timer]))
    except torch.OutOfMemoryError:
        return {"status": "out of memory", "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}
    except TimeLimit:
        done = "during prefill" if not timer.times else f"after {len(timer.times)} tokens"
        return {"status": f"did not finish in {limit_s + 30:.0f} s ({done})",
                "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}
    finally:
        if limit_s is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
    steps = [b - a for a, b in zip(timer.times, timer.times[1:])]
    row = {
        "prefill_s": timer.times[0] - start,
        "decode_ms_per_step": statistics.median(steps) * 1e3 if steps else None,
        "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "tokens": out[:, ids.shape[1]:],
    }
    if len(timer.times) < new_tokens:
        row["status"] = f"stopped after {len(timer.times)} of {new_tokens} tokens: time limit {limit_s} s"
    return row


def prefilled(model, ids, mask, cache: QSAPagedCache) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache`` reset and holding the prompt ``ids`` (an untimed greedy call of one token), the device idle:
    the ids and attention mask of a call that continues it."""
    cache.reset()
    first = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return first, torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)


def decode_ms_end_to_end(model, ids, mask, new_tokens: int, cache: QSAPagedCache, sample: bool = False,
                         calls: int = 3) -> float:
    """Milliseconds a decode step adds to a plain generate() call, as a user makes it (no stopping criterion
    or streamer, so our loop reads the host once, at the end). Each timed call continues a prompt the cache
    already holds (prefilled by an untimed call of one token), so a timed call's own prefill is one token:
    the best of ``calls`` calls of ``new_tokens`` against the best of as many of one token, over
    ``new_tokens - 1``. With ``sample``, sampled calls (top-k 50) instead of greedy ones. (Timing whole calls from the prompt put the prompt's prefill, and its run-to-run
    spread of tens of milliseconds, into both terms: at 16 new tokens that spread alone moved the figure by
    more than a millisecond a step.)"""

    best = {}
    for n in (1, new_tokens):
        for _ in range(calls):
            first, more = prefilled(model, ids, mask, cache)
            start = time.perf_counter()
            model.generate(first, attention_mask=more, past_key_values=cache, max_new_tokens=n, pad_token_id=0,
                           eos_token_id=None, **({"do_sample": True, "top_k": 50} if sample else {"do_sample": False}))
            if ids.is_cuda:
                torch.cuda.synchronize()
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - start)
    return (best[new_tokens] - best[1]) / (new_tokens - 1) * 1e3


TOP_KERNELS = 64  # the graphed step's kernels by GPU time that a result lists (every name, at the bench shapes)


def graphed_step_stats(model, cache: QSAPagedCache, steps: int = 3, top: int = TOP_KERNELS) -> dict:
    """Kernels (and copies) one replayed decode graph launches, and the share of a step's wall time the
    GPU is busy (the union of its kernels' intervals under the profiler over the median step timed without
    it). Runs ``steps + 3`` decode steps on ``cache`` (same length every row, room left for them)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    batch, device = cache.num_rows, next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size

    def step():
        ids = torch.randint(2, vocab, (batch, 1), device=device)
        mask = torch.ones(batch, cache.lengths[0] + 1, dtype=torch.long, device=device)
        model(ids, attention_mask=mask, past_key_values=cache)

    graphs, model.use_cuda_graphs = getattr(model, "use_cuda_graphs", True), True  # unset means on
    try:
        with torch.no_grad():
            step()  # captured here if this bucket has no graph yet
            step()
            torch.cuda.synchronize()
            walls = []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - start)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
    finally:
        model.use_cuda_graphs = graphs
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = sum("memcpy" in e.name.lower() or "memset" in e.name.lower() for e in events)
    busy, end = 0.0, float("-inf")
    for s, e in sorted((e.time_range.start, e.time_range.end) for e in events):  # overlaps count once
        if e > end:
            busy += e - max(s, end)
            end = e
    wall_us = statistics.median(walls) * 1e6
    by_name: dict[str, list] = {}
    for e in events:
        row = by_name.setdefault(e.name[:90], [0, 0.0])
        row[0] += 1
        row[1] += e.time_range.end - e.time_range.start
    listed = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"graph_kernels": len(events) - copies, "graph_copies": copies, "graph_busy_us": round(busy, 1),
            "step_wall_us": round(wall_us, 1), "gpu_busy_share": round(busy / wall_us, 3) if events else None,
            "graph_top_kernels": [[name, count, round(us, 1)] for name, (count, us) in listed]}


def kernels_without_pdl(model, config, ids, mask) -> list:
    """The graphed step's kernels by GPU time as `graphed_step_stats` lists them, in a step captured without early
    launch: under ``pdl`` each kernel is resident before the one ahead of it ends and waits inside itself, so its
    profiled time holds that wait and the list no longer says where the step's time goes."""
    with fusions.fused(("pdl",), on=False):
        cache = QSAPagedCache(config, max_batch_size=ids.shape[0], max_cache_len=ids.shape[1] + 16)
        run(model, ids, mask, 1, cache)
        return graphed_step_stats(model, cache)["graph_top_kernels"]


def emit(result: dict, jsonl: str | None) -> None:
    """Print ``result`` as one JSON line, and append it to ``jsonl`` when given."""
    print(json.dumps(result), flush=True)
    if jsonl:
        with open(jsonl, "a") as f:
            f.write(json.dumps(result) + "\n")


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * 10 * x.numel() / (start.elapsed_time(end) / 1e3)


def lookup_rows_per_token(model) -> dict[str, int]:
    """Lookup tables a decode step reads only a few rows of: weight name -> rows read per token.

    The token embedding gives one row a token; Qwen4Exp's PLE n-gram embedding one row per n-gram head
    (``ngram_size - 1`` n-gram lengths of ``heads_per_ngram`` heads). A table the LM head shares (tied
    weights) is read whole and is not listed."""
    output = model.get_output_embeddings()
    tied = output.weight if output is not None else None
    rows = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Embedding) or module.weight is tied:
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        per_token = 1
        if name.endswith("ngram_embedding"):
            per_token = (parent.ngram_size - 1) * parent.heads_per_ngram
        rows[f"{name}.weight"] = per_token
    return rows


def decode_bytes(model, config, batch: int, length: int, whole_tables: bool = False) -> float:
    """Bytes one decode step must read (weights it touches, cached state it reads). ``whole_tables`` counts
    the lookup tables whole, as the results lines without ``floor_lookup_rows`` did (`benchmarks/floors.py`
    recomputes their floors)."""
    lookups = {} if whole_tables else lookup_rows_per_token(model)
    expert_bytes, other = 0, 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name in lookups:  # the rows the batch's tokens look up, not the table
            other += min(p.shape[0], batch * lookups[name]) * p[0].numel() * p.element_size()
        elif ".experts." in name:
            expert_bytes += size
        else:
            other += size
    num_experts = getattr(config, "num_experts", None) or config.n_routed_experts
    top_k = config.num_experts_per_tok
    touched = num_experts * (1 - (1 - top_k / num_experts) ** batch)  # expected distinct experts, uniform routing
    weights = other + expert_bytes * touched / num_experts
    b = 2  # bf16
    state = 0
    for kind in config.layer_types:
        if kind == "linear_attention":
            per_row = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
            state += 2 * per_row  # read and written
        elif kind == "indexed_attention":
            groups = length // config.indexer_compress_ratio
            selected = min(length, config.indexer_budget + config.indexer_compress_ratio)
            state += groups * config.indexer_head_dim * b + 2 * selected * config.num_key_value_heads * config.head_dim * b
        elif kind == "hybrid_sliding":
            keys = min(length, config.sliding_window_size)
            state += 2 * keys * config.swa_num_key_value_heads * config.swa_head_dim * b
        else:
            state += 2 * length * config.num_key_value_heads * config.head_dim * b
    return weights + batch * state


H200_BF16_PEAK = 989e12  # dense bf16 tensor-core FLOP/s of the H200 (spec sheet)


def prefill_flops(model, config, batch: int, length: int) -> float:
    """Model FLOPs of a prefill: 2 per weight a token touches (embedding lookups and the LM head, which
    prefill runs on one position, left out; routed experts counted at top_k / num_experts), plus the
    attention the design must do at each position p: QSA index scores over its p // r visible groups
    and attention over its selected tokens, GatedDeltaNet state update and read-out, Inkling sliding
    window and full causal attention."""
    weights = 0.0
    num_experts = getattr(config, "num_experts", None) or config.n_routed_experts
    for name, p in model.named_parameters():
        if "embed" in name or name.startswith("lm_head"):
            continue
        weights += p.numel() * (config.num_experts_per_tok / num_experts if ".experts." in name else 1)
    pos = torch.arange(length, dtype=torch.float64)
    attention = 0.0
    for kind in config.layer_types:
        if kind == "linear_attention":
            heads = config.linear_num_value_heads
            attention += length * 4 * heads * config.linear_key_head_dim * config.linear_value_head_dim
        elif kind == "indexed_attention":
            r = config.indexer_compress_ratio
            width = config.indexer_budget + r - 1
            index = 2 * config.indexer_n_heads * config.indexer_head_dim * ((pos + 1) // r).sum().item()
            attend = 4 * config.num_attention_heads * config.head_dim * (pos + 1).clamp(max=width).sum().item()
            attention += index + attend
        elif kind == "hybrid_sliding":
            keys = (pos + 1).clamp(max=config.sliding_window_size).sum().item()
            attention += 4 * config.swa_num_attention_heads * config.swa_head_dim * keys
        else:
            attention += 4 * config.num_attention_heads * config.head_dim * (pos + 1).sum().item()
    return batch * (2 * weights * length + attention)


def commit() -> str:
    """The commit measured: ``BENCH_COMMIT`` if set (a copied working tree may carry no git history, or an
    older one), else git's HEAD, with ``+changes`` when tracked files differ from it (the figures are then
    not that commit's)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=here).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, cwd=here).stdout.strip()
    except OSError:
        return "unknown"
    return (head + "+changes" if changed else head) if head else "unknown"


def choose_projections(one_token: str | None, alone_max_tokens: int | None) -> dict:
    """Set the projections kernel's one-token tiles (``"gemv"``: the shipped `linears_triton.default_tiles`,
    ``"dot"``: `ONE_TOKEN_DOT_TILES` for every reduction) and `linears.ALONE_MAX_TOKENS` for this process, where
    given; the choices that differ from the defaults, as result keys."""
    from hf_qsa_cache.ops import linears, linears_triton

    chosen = {}
    if one_token == "dot":
        linears_triton.ONE_TOKEN_TILES = linears_triton.ONE_TOKEN_WIDE_TILES = linears_triton.ONE_TOKEN_DOT_TILES
        chosen["one_token_projections"] = "dot"
    if alone_max_tokens is not None and alone_max_tokens != linears.ALONE_MAX_TOKENS:
        linears.ALONE_MAX_TOKENS = alone_max_tokens
        chosen["alone_max_tokens"] = alone_max_tokens
    return chosen


def choose_mix_tiles(one_token: str | None) -> dict:
    """Set the hyper-connection projections' one-token tiles for this process (``"dot"``:
    `hyper_connection_triton.ONE_TOKEN_DOT_MIX_TILES`; or a JSON object of `MixTiles` fields, as
    `sweep_hc_tiles.py` prints its best), where given; the choice, as a result key."""
    if one_token is None:
        return {}
    from hf_qsa_cache.ops import hyper_connection_triton as hct

    if one_token == "dot":
        tiles = hct.ONE_TOKEN_DOT_MIX_TILES
    else:
        tiles = hct.MixTiles(**json.loads(one_token))
    hct.ONE_TOKEN_MIX_TILES = tiles
    return {"one_token_mix_tiles": dataclasses.asdict(tiles)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cases", nargs="+", default=["1x16384", "8x4096"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--graphs", choices=["on", "off", "both"], default="both")
    parser.add_argument("--skip-upstream", action="store_true")
    parser.add_argument("--upstream-limit", type=float, default=None,
                        help="stop upstream's generation after this many seconds")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None,
                        help="tokens per prefill chunk, summed over the batch (default: the model's)")
    parser.add_argument("--cache-len", type=int, default=0,
                        help="size our timed cache for this many tokens (default: the prompt and new tokens)")
    parser.add_argument("--loops", nargs="+", choices=["ours", "transformers"], default=["ours"],
                        help="decode loops to time in: ours (what generate() takes, `lean_decoding`) "
                             "and transformers' `_sample`")
    parser.add_argument("--sample", action="store_true",
                        help="decode_ms_end_to_end from sampled calls (top-k 50) instead of greedy ones")
    parser.add_argument("--one-token-projections", choices=["dot", "gemv"], default=None,
                        help="the projections kernel's one-token tiles: its padded tl.dot ones or its GEMV form "
                             "(default: gemv, linears_triton.default_tiles)")
    parser.add_argument("--alone-max-tokens", type=int, default=None,
                        help="steps of at most this many tokens run a projection alone (o_proj, out_proj) in the "
                             "projections kernel (default: linears.ALONE_MAX_TOKENS; 0: cuBLAS)")
    parser.add_argument("--one-token-mix-tiles", default=None,
                        help="the hyper-connection projections' one-token tiles: dot "
                             "(hyper_connection_triton.ONE_TOKEN_DOT_MIX_TILES) or a JSON object of MixTiles "
                             "fields (default: ONE_TOKEN_MIX_TILES, the GEMV form)")
    parser.add_argument("--end-to-end-calls", type=int, default=3,
                        help="decode_ms_end_to_end: the best of this many calls (more where the host is noisy)")
    parser.add_argument("--step-undo", choices=["on", "off", "both"], default="on",
                        help="our cache's step_undo (off: no copy-aside of in-place state, as continuous batching "
                             "builds its cache); both: each case twice")
    parser.add_argument("--jsonl", default=None, help="append lines here (default: results_file of the GPU)")
    args = parser.parse_args()
    projection_choices = {**choose_projections(args.one_token_projections, args.alone_max_tokens),
                          **choose_mix_tiles(args.one_token_mix_tiles)}

    torch.manual_seed(0)
    dtype = torch.bfloat16
    if args.model == "qwen4_exp":
        from modeling import Qwen4ExpForCausalLM as Ours

        config = qwen4_exp_config(args.layers)
        Upstream = transformers.Qwen4ExpForCausalLM
    else:
        from modeling import InklingForCausalLM as Ours

        config = inkling_config(args.layers)
        Upstream = transformers.InklingForCausalLM
    torch.set_default_dtype(dtype)  # build in bf16 on the GPU: no fp32 copy of a 40-layer model
    with torch.device("cuda"):
        ours = Ours(config).eval()
    if args.prefill_chunk_tokens:
        ours.prefill_chunk_tokens = args.prefill_chunk_tokens
    upstream = None
    if not args.skip_upstream:
        with torch.device("cuda"):
            upstream = Upstream(config).eval()
        upstream.load_state_dict(ours.state_dict(), strict=True)
    torch.set_default_dtype(torch.float32)
    bandwidth = copy_bandwidth()
    sha = commit()
    print(json.dumps({"copy_bandwidth_TBps": round(bandwidth / 1e12, 2), "commit": sha}), flush=True)
    graph_modes = {"on": [True], "off": [False], "both": [True, False]}[args.graphs]

    # Warm-up (kernel compilation) on a short ragged batch.
    ids = torch.randint(2, config.vocab_size, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    for graphs in graph_modes:
        ours.use_cuda_graphs = graphs
        run(ours, ids, mask, 4)
    if upstream is not None:
        run(upstream, ids[:1], mask[:1], 4)

    gpu = torch.cuda.get_device_name()
    args.jsonl = args.jsonl or results_file(gpu)
    os.makedirs(os.path.dirname(args.jsonl), exist_ok=True)
    for case in args.cases:
        batch, length = (int(x) for x in case.split("x"))
        ids = torch.randint(2, config.vocab_size, (batch, length), device="cuda")
        mask = torch.ones_like(ids)
        common = {"model": args.model, "layers": args.layers, "batch": batch, "prompt_len": length,
                  "new_tokens": args.new_tokens, "commit": sha, "prefill_chunk_tokens": ours.prefill_chunk_tokens,
                  "fused": fusions.active(), "gpu": gpu, **projection_choices}
        if args.cache_len:
            common["cache_len"] = args.cache_len
        floor_ms = decode_bytes(ours, config, batch, length) / bandwidth * 1e3
        flops = prefill_flops(ours, config, batch, length)
        rows = []
        undo_modes = {"on": [True], "off": [False], "both": [True, False]}[args.step_undo]
        for graphs, loop, step_undo in [(g, lp, u) for g in graph_modes for lp in args.loops for u in undo_modes]:
            ours.use_cuda_graphs = graphs
            ours.lean_decoding = loop == "ours"
            # Kernel tuning keys on shapes: warm up at this case's batch first (a fresh cache each run); two
            # prefill chunks' worth of prompt reach every chunk shape.
            warm = min(length, 2 * max(1, ours.prefill_chunk_tokens // batch))
            run(ours, ids[:, :warm], mask[:, :warm], 3,
                QSAPagedCache(config, max_batch_size=batch, max_cache_len=warm + args.new_tokens))
            # Room for `graphed_step_stats`'s steps after the timed generation.
            cache = QSAPagedCache(config, max_batch_size=batch, step_undo=step_undo,
                                  max_cache_len=max(args.cache_len, length + args.new_tokens + 8))
            result = run(ours, ids, mask, args.new_tokens, cache)
            if graphs and "status" not in result:
                result.update(graphed_step_stats(ours, cache))
            if result.get("prefill_s") and result["prefill_s"] < 2:  # short prompts: two more prefills are cheap
                result["decode_ms_end_to_end"] = decode_ms_end_to_end(ours, ids, mask, args.new_tokens, cache,
                                                                      sample=args.sample,
                                                                      calls=args.end_to_end_calls)
                if args.sample:
                    result["end_to_end_sampled"] = True
            stats = cache.memory_stats()
            result["cache_gib"] = stats["total_bytes"] / 2**30
            result["store_gib"] = {name: round(size / 2**30, 4) for name, size in stats["bytes"].items()}
            if result.get("prefill_s"):
                result["prefill_peak_share"] = flops / result["prefill_s"] / H200_BF16_PEAK
            del cache
            if graphs and "status" not in result and fusions.enabled("pdl") and result.get("prefill_s", 99) < 2:
                result["graph_top_kernels_without_pdl"] = kernels_without_pdl(ours, config, ids, mask)
            rows.append({**common, "impl": "paged", "graphs": graphs, "loop": loop, "step_undo": step_undo, **result,
                         "floor_ms": floor_ms, "floor_lookup_rows": True})
        if upstream is not None:
            result = run(upstream, ids, mask, args.new_tokens, limit_s=args.upstream_limit)
            rows.append({**common, "impl": "upstream", "graphs": False, **result})
        reference = rows[-1].get("tokens") if upstream is not None else None
        with open(args.jsonl, "a") as f:
            for row in rows:
                tokens = row.pop("tokens", None)
                if reference is not None and tokens is not None and row["impl"] == "paged":
                    # bf16 rounding differs between implementations: how long the greedy paths agree.
                    n = min(tokens.shape[1], reference.shape[1])
                    agree = (tokens[:, :n] == reference[:, :n]).int().cumprod(dim=1).sum(dim=1)
                    row["greedy_tokens_agreeing_per_row"] = agree.tolist()
                line = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
                f.write(json.dumps(line) + "\n")
                print(json.dumps(line), flush=True)
        up = rows[-1] if upstream is not None else None
        for row in rows:
            if row["impl"] == "paged" and up and up.get("decode_ms_per_step") and row.get("decode_ms_per_step"):
                end_to_end = row.get("decode_ms_end_to_end")
                print(f"  {case} graphs={row['graphs']} loop={row['loop']}: decode "
                      f"{row['decode_ms_per_step']:.2f} ms/step "
                      f"({up['decode_ms_per_step'] / row['decode_ms_per_step']:.1f}x upstream), floor "
                      f"{floor_ms:.2f} ms ({row['decode_ms_per_step'] / floor_ms:.1f}x floor"
                      + (f", {end_to_end:.2f} ms end to end" if end_to_end else "")
                      + (f", {row['graph_kernels']} kernels, GPU busy {row['gpu_busy_share']:.0%}"
                         if row.get("gpu_busy_share") is not None else "") + "); prefill "
                      f"{row['prefill_s']:.2f} s ({up['prefill_s'] / row['prefill_s']:.1f}x upstream)", flush=True)


if __name__ == "__main__":
    main()
