"""Upstream transformers vs hf-qsa-cache, side by side in one run, same random weights, bf16, one GPU.

    python benchmarks/bench_generate.py --model qwen4_exp --cases 1x16384 8x4096 --new-tokens 32
    python benchmarks/bench_generate.py --model inkling --layers 6 --cases 1x16384 --new-tokens 32

Reports prefill seconds, decode ms/step and peak GPU memory for each (batch x prompt length), for
upstream (`transformers.<Model>ForCausalLM` with its DynamicCache) and ours (`modeling.<Model>` with
`QSAPagedCache`), plus whether the greedy tokens agree. The shapes built below are listed in
benchmarks/RESULTS.md ("Benchmark shapes").
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_qsa_cache import QSAPagedCache


def qwen4_exp_config(layers: int):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

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
        max_position_embeddings=65536,
    )


def inkling_config(layers: int):
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    return InklingTextConfig(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=layers,
        layer_types=["hybrid" if (i + 1) % 6 == 0 else "hybrid_sliding" for i in range(layers)],
        num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        swa_num_attention_heads=16, swa_num_key_value_heads=4, swa_head_dim=128,
        sliding_window_size=512, d_rel=16, rel_extent=1024, n_routed_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=512, intermediate_size=2048, conv_kernel_size=4, eos_token_id=1, pad_token_id=0,
        max_position_embeddings=65536,
    )


class StepTimer(StoppingCriteria):
    """Called once per generated token: the first call marks the end of prefill."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run(model, ids, mask, new_tokens, cache=None):
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    timer = StepTimer()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None,
                         stopping_criteria=StoppingCriteriaList([timer]))
    prefill = timer.times[0] - start
    decode = (timer.times[-1] - timer.times[0]) / max(1, len(timer.times) - 1)
    peak = torch.cuda.max_memory_allocated() - base
    return out[:, ids.shape[1]:], prefill, decode * 1e3, peak / 2**30


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cases", nargs="+", default=["1x16384", "8x4096"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-upstream", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--triton-qsa", action="store_true", help="use the opt-in Triton QSA kernels")
    args = parser.parse_args()
    if args.triton_qsa:
        import hf_qsa_cache.ops.qsa as qsa_ops

        qsa_ops.USE_TRITON = True

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
    upstream = Upstream(config).to("cuda", dtype).eval()
    ours = Ours(config).to("cuda", dtype).eval()
    ours.load_state_dict(upstream.state_dict(), strict=True)
    if args.skip_upstream:
        del upstream
        upstream = None

    # Warm-up (kernel compilation) on a short ragged batch; also a bf16 agreement check.
    ids = torch.randint(2, config.vocab_size, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    run(ours, ids, mask, 4)
    if upstream is not None:
        run(upstream, ids[:1], mask[:1], 4)

    results = []
    for case in args.cases:
        batch, length = (int(x) for x in case.split("x"))
        ids = torch.randint(2, config.vocab_size, (batch, length), device="cuda")
        mask = torch.ones_like(ids)
        row = {"model": args.model, "batch": batch, "prompt": length, "new_tokens": args.new_tokens}
        # Kernel autotuning (fla, Triton) keys on shapes: warm up at this case's shape first. Upstream runs
        # after ours and shares the tuned kernels.
        run(ours, ids, mask, 2, QSAPagedCache(config, max_batch_size=batch, max_cache_len=length + 2))
        cache = QSAPagedCache(config, max_batch_size=batch, max_cache_len=length + args.new_tokens)
        tokens, row["ours_prefill_s"], row["ours_decode_ms"], row["ours_peak_gib"] = run(
            ours, ids, mask, args.new_tokens, cache)
        row["ours_cache_gib"] = cache.memory_stats()["total_bytes"] / 2**30
        del cache
        if upstream is not None:
            ref_tokens, row["up_prefill_s"], row["up_decode_ms"], row["up_peak_gib"] = run(
                upstream, ids, mask, args.new_tokens)
            row["prefill_speedup"] = row["up_prefill_s"] / row["ours_prefill_s"]
            row["decode_speedup"] = row["up_decode_ms"] / row["ours_decode_ms"]
            # bf16 rounding differs between implementations; report how long the greedy paths agree.
            agree = (tokens == ref_tokens).int().cumprod(dim=1).sum(dim=1)
            row["greedy_tokens_agreeing_per_row"] = agree.tolist()
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
