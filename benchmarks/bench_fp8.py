"""fp8 caches against bf16 ones, side by side in one run: logit error, memory, speed.

* error: teacher-forced logits of the model in bf16 on a bf16 cache and on an fp8 cache (``kv_cache_dtype`` and,
  on Qwen4Exp, ``index_cache_dtype``), each against the same weights in fp32 on an fp32 cache; a prompt long enough
  that QSA selects and windows evict. Also greedy agreement with the fp32 model over ``--greedy-tokens`` tokens.
* memory: bytes per token of the paged stores (scales included), tokens per GiB of cache, and the longest
  single-row context the device holds at ``--layers`` (what is free after the weights, less 4 GiB for activations).
* speed (GPU): prefill and the median decode step (CUDA graphs on) for each case, bf16 and fp8 caches, one model.

    python benchmarks/bench_fp8.py --model qwen4_exp --layers 40 --cases 1x4096 1x131072 8x32768
    python benchmarks/bench_fp8.py --device cpu --tiny          # smoke run (tests/scripts/test_bench_fp8.py)

Appends one JSON line per measurement to ``--jsonl`` (default: benchmarks/results/fp8.jsonl).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generate import commit, inkling_config, qwen4_exp_config  # noqa: E402
from hf_qsa_cache import QSAPagedCache  # noqa: E402
from hf_qsa_cache.layout import build_layout  # noqa: E402

FP8 = torch.float8_e4m3fn
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fp8.jsonl")
HEADROOM = 4 << 30  # activations of a decode step and the allocator's slack, kept free when sizing a context


def tiny_config(model: str):
    """Small configs with the families' mechanisms on at small prompts (QSA budget 16 of 64+ groups, window 8)."""
    if model == "qwen4_exp":
        from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

        return Qwen4ExpTextConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=4,
            layer_types=["linear_attention", "indexed_attention"] * 2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                          "mrope_section": [4, 2, 2], "mrope_interleaved": True},
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=4, hc_count=2, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=16,
            ple_conv_kernel_size=2, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=31,
            make_ngram_vocab_size_divisible_by=8, indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=32,
            indexer_budget=16, indexer_compress_ratio=2, eos_token_id=1, pad_token_id=0, bos_token_id=None,
            output_gate_type="sigmoid", max_position_embeddings=4096,
        )
    from transformers import InklingTextConfig

    return InklingTextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=4,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=32,
        sliding_window_size=8, d_rel=4, rel_extent=16, log_scaling_n_floor=4, log_scaling_alpha=0.5,
        conv_kernel_size=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=4,
        n_shared_experts=1, dense_mlp_idx=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
        eos_token_id=None,
    )


def model_class(model: str):
    from modeling import InklingForCausalLM, Qwen4ExpForCausalLM

    return Qwen4ExpForCausalLM if model == "qwen4_exp" else InklingForCausalLM


def fp8_kwargs(model: str) -> dict:
    return {"kv_cache_dtype": FP8, **({"index_cache_dtype": FP8} if model == "qwen4_exp" else {})}


def build(model: str, config, device, dtype, std: float | None):
    """The model in ``dtype`` on ``device``, seeded (``std``: every weight drawn N(0, std), norms left as built)."""
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            net = model_class(model)(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    if std is not None:
        with torch.no_grad():
            for name, p in net.named_parameters():
                if p.dtype.is_floating_point and "norm" not in name and "A_log" not in name:
                    p.normal_(0.0, std)
    return net


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def emit(line: dict, path: str) -> None:
    line = {k: round(v, 5) if isinstance(v, float) else v for k, v in line.items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps(line), flush=True)


# ----------------------------------------------------------------------------- error
def forced_logits(net, prompt, forced, cache_kw) -> torch.Tensor:
    """Logits ``[forced, V]`` (fp32) at the prompt's last position and each teacher-forced step after it."""
    n = prompt.shape[1]
    cache = QSAPagedCache(net.config, 1, n + forced.shape[1] + 1, **cache_kw)
    with torch.no_grad():
        out = [net(prompt, past_key_values=cache, logits_to_keep=1).logits[0, -1].float()]
        for t in range(forced.shape[1] - 1):
            out.append(net(forced[:, t:t + 1], past_key_values=cache).logits[0, -1].float())
    return torch.stack(out)


def greedy(net, prompt, tokens, cache_kw) -> torch.Tensor:
    cache = QSAPagedCache(net.config, 1, prompt.shape[1] + tokens + 1, **cache_kw)
    with torch.no_grad():
        out = net.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                           max_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, prompt.shape[1]:]


def error_lines(args, model: str, config, device) -> list[dict]:
    std = 0.3 if args.tiny else None
    ref = build(model, config, device, torch.float32, std)
    low = copy.deepcopy(ref).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, config.vocab_size, (1, args.error_prompt), generator=g).to(device)
    forced = torch.randint(2, config.vocab_size, (1, args.forced), generator=g).to(device)
    want = forced_logits(ref, prompt, forced, {})
    bf16 = forced_logits(low, prompt, forced, {})
    fp8 = forced_logits(low, prompt, forced, fp8_kwargs(model))
    on_fp32 = forced_logits(ref, prompt, forced, fp8_kwargs(model))  # the fp32 model on an fp8 cache
    err = {name: (got - want).abs().mean().item() for name, got in
           (("bf16_cache", bf16), ("fp8_cache", fp8), ("fp32_model_fp8_cache", on_fp32))}
    line = {"section": "error", "model": model, "layers": config.num_hidden_layers, "prompt_len": args.error_prompt,
            "forced_tokens": args.forced, "device": device_name(device),
            "err_bf16_model_bf16_cache": err["bf16_cache"], "err_bf16_model_fp8_cache": err["fp8_cache"],
            "ratio_fp8_to_bf16": err["fp8_cache"] / err["bf16_cache"],
            "err_fp32_model_fp8_cache": err["fp32_model_fp8_cache"],
            "ratio_fp32_model_fp8_cache_to_bf16_model": err["fp32_model_fp8_cache"] / err["bf16_cache"]}
    if args.greedy_tokens:
        want_tokens = greedy(ref, prompt, args.greedy_tokens, {})
        for name, kw in (("bf16_cache", {}), ("fp8_cache", fp8_kwargs(model))):
            got = greedy(low, prompt, args.greedy_tokens, kw)
            line[f"greedy_agree_{name}"] = (got == want_tokens).float().mean().item()
            line[f"greedy_prefix_{name}"] = int((got == want_tokens).int().cumprod(0).sum())
        fp8_vs_bf16 = greedy(low, prompt, args.greedy_tokens, fp8_kwargs(model)) == greedy(low, prompt,
                                                                                             args.greedy_tokens, {})
        line["greedy_agree_fp8_vs_bf16_cache"] = fp8_vs_bf16.float().mean().item()
    del ref, low
    return [line]


# ----------------------------------------------------------------------------- memory
def memory_lines(args, model: str, config, device, weights_bytes: int | None) -> list[dict]:
    lines = []
    layout = {name: build_layout(config, 1, 4096, **kw) for name, kw in (("bf16", {}), ("fp8", fp8_kwargs(model)))}
    per_token = {name: layout[name].bytes_per_token("main", torch.bfloat16) for name in layout}
    fp32 = build_layout(config, 1, 4096).bytes_per_token("main", torch.float32)
    line = {"section": "memory", "model": model, "layers": config.num_hidden_layers,
            "bytes_per_token_fp32": fp32, "bytes_per_token_bf16": per_token["bf16"],
            "bytes_per_token_fp8": per_token["fp8"], "fp8_over_bf16": per_token["fp8"] / per_token["bf16"],
            "fp8_over_fp32": per_token["fp8"] / fp32,
            "tokens_per_gib_bf16": 2**30 / per_token["bf16"], "tokens_per_gib_fp8": 2**30 / per_token["fp8"]}
    if torch.device(device).type == "cuda" and weights_bytes is not None:
        free = torch.cuda.mem_get_info()[0]
        # The per-row state (GatedDeltaNet, ring) does not grow with the context: one row's is small.
        room = free - HEADROOM
        line["device"] = device_name(device)
        line["free_gib_after_weights"] = free / 2**30
        for name in ("bf16", "fp8"):
            tokens = int(room // per_token[name]) // 64 * 64
            kw = fp8_kwargs(model) if name == "fp8" else {}
            try:  # the cache of that length is really allocated
                cache = QSAPagedCache(config, 1, tokens, device=device, dtype=torch.bfloat16, **kw)
                line[f"longest_context_{name}"] = tokens
                line[f"cache_gib_{name}"] = cache.memory_stats()["total_bytes"] / 2**30
                del cache
            except torch.OutOfMemoryError:
                line[f"longest_context_{name}"] = f"out of memory at {tokens}"
            torch.cuda.empty_cache()
        if isinstance(line.get("longest_context_fp8"), int) and isinstance(line.get("longest_context_bf16"), int):
            line["longest_fp8_over_bf16"] = line["longest_context_fp8"] / line["longest_context_bf16"]
    lines.append(line)
    return lines


# ----------------------------------------------------------------------------- speed
def timed_generate(net, ids, new_tokens: int, cache) -> dict:
    """Prefill seconds and the median decode step (ms) of one greedy call, each step timed (a synchronising
    stopping criterion: the same overhead on both caches)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    device = ids.device
    times = []

    class Timer(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            sync(device)
            times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        net.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                     do_sample=False, pad_token_id=0, eos_token_id=None, stopping_criteria=StoppingCriteriaList([Timer()]))
    steps = [b - a for a, b in zip(times, times[1:])]
    return {"prefill_s": times[0] - start, "decode_ms_per_step": statistics.median(steps) * 1e3 if steps else None}


def speed_lines(args, model: str, config, net, device, deadline: float) -> list[dict]:
    lines = []
    warm = torch.randint(2, config.vocab_size, (1, 64), device=device)
    for kw in ({}, fp8_kwargs(model)):  # compile both caches' kernels first
        timed_generate(net, warm, 4, QSAPagedCache(config, 1, 80, **kw))
    for case in args.cases:
        batch, length = (int(x) for x in case.split("x"))
        if time.perf_counter() > deadline:
            lines.append({"section": "speed", "model": model, "case": case, "status": "skipped: time budget"})
            continue
        ids = torch.randint(2, config.vocab_size, (batch, length), device=device)
        line = {"section": "speed", "model": model, "layers": config.num_hidden_layers, "batch": batch,
                "prompt_len": length, "new_tokens": args.new_tokens, "device": device_name(device)}
        for name, kw in (("bf16", {}), ("fp8", fp8_kwargs(model))):
            cache = QSAPagedCache(config, batch, length + args.new_tokens + 1, **kw)
            try:
                got = timed_generate(net, ids, args.new_tokens, cache)
            except torch.OutOfMemoryError:
                got = {"status": "out of memory"}
            line.update({f"{k}_{name}": v for k, v in got.items()})
            line[f"cache_gib_{name}"] = cache.memory_stats()["total_bytes"] / 2**30
            del cache
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
        if line.get("decode_ms_per_step_fp8") and line.get("decode_ms_per_step_bf16"):
            line["decode_speedup_fp8"] = line["decode_ms_per_step_bf16"] / line["decode_ms_per_step_fp8"]
            line["prefill_speedup_fp8"] = line["prefill_s_bf16"] / line["prefill_s_fp8"]
        lines.append(line)
        emit({**line, "commit": args.commit}, args.jsonl)
    return lines


def device_name(device) -> str:
    return torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen4_exp", "inkling"], choices=["qwen4_exp", "inkling"])
    parser.add_argument("--layers", type=int, default=40, help="speed and memory (Qwen4Exp; Inkling uses 6)")
    parser.add_argument("--error-layers", type=int, default=None, help="the error's model (default 8 / 6 layers)")
    parser.add_argument("--cases", nargs="+", default=["1x4096", "1x131072", "8x32768"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--error-prompt", type=int, default=8192)
    parser.add_argument("--forced", type=int, default=32)
    parser.add_argument("--greedy-tokens", type=int, default=256)
    parser.add_argument("--sections", nargs="+", default=["error", "memory", "speed"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (a smoke run on the CPU)")
    parser.add_argument("--time-budget", type=float, default=1e9, help="seconds: later speed cases are skipped")
    parser.add_argument("--jsonl", default=RESULTS)
    args = parser.parse_args()
    args.commit = commit()
    deadline = time.perf_counter() + args.time_budget
    if args.tiny:
        args.error_prompt, args.forced, args.greedy_tokens = min(args.error_prompt, 80), min(args.forced, 6), \
            min(args.greedy_tokens, 8)
        args.cases = [c for c in args.cases if int(c.split("x")[0]) * int(c.split("x")[1]) <= 256] or ["1x48", "2x32"]
        args.new_tokens = min(args.new_tokens, 4)
    for model in args.models:
        def config_of(layers):
            if args.tiny:
                return tiny_config(model)
            return qwen4_exp_config(layers) if model == "qwen4_exp" else inkling_config(layers)

        if "error" in args.sections:
            error_layers = args.error_layers or (8 if model == "qwen4_exp" else 6)
            for line in error_lines(args, model, config_of(error_layers), args.device):
                emit({**line, "commit": args.commit}, args.jsonl)
        layers = args.layers if model == "qwen4_exp" else 6
        config = config_of(layers)
        net = None
        if "speed" in args.sections or torch.device(args.device).type == "cuda":
            net = build(model, config, args.device, torch.bfloat16, 0.02 if not args.tiny else 0.3)
        if "memory" in args.sections:
            weights = sum(p.numel() * p.element_size() for p in net.parameters()) if net is not None else None
            for line in memory_lines(args, model, config, args.device, weights):
                emit({**line, "commit": args.commit}, args.jsonl)
        if "speed" in args.sections:
            speed_lines(args, model, config, net, args.device, deadline)
        del net
    return 0


if __name__ == "__main__":
    sys.exit(main())
