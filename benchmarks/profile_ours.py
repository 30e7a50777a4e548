"""Profile our prefill and decode (torch profiler tables), to see where the time goes.

    python benchmarks/profile_ours.py --model qwen4_exp --batch 1 --prompt 16384
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench_generate import inkling_config, qwen4_exp_config
from hf_qsa_cache import QSAPagedCache


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=None, help="default: 8 (Qwen4Exp), 6 (Inkling)")
    parser.add_argument("--shapes", action="store_true", help="prefill ops by name and input shapes")
    args = parser.parse_args()
    if args.model == "qwen4_exp":
        from modeling import Qwen4ExpForCausalLM as Ours
        config = qwen4_exp_config(args.layers or 8)
    else:
        from modeling import InklingForCausalLM as Ours
        config = inkling_config(args.layers or 6)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Ours(config).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(2, config.vocab_size, (args.batch, args.prompt), device="cuda")

    def prefill():
        cache = QSAPagedCache(config, args.batch, args.prompt + args.steps + 1)
        with torch.no_grad():
            out = model(ids, past_key_values=cache, logits_to_keep=1)
        torch.cuda.synchronize()
        return cache, out.logits.argmax(-1)

    def decode(cache, tok):
        with torch.no_grad():
            for _ in range(args.steps):
                tok = model(tok, past_key_values=cache, logits_to_keep=1).logits.argmax(-1)
        torch.cuda.synchronize()

    decode(*prefill())  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=args.shapes) as prof:
        cache, tok = prefill()
    print("=== prefill, by CUDA time")
    print(prof.key_averages(group_by_input_shape=args.shapes).table(sort_by="cuda_time_total", row_limit=30))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode(cache, tok)
    print("=== decode, by CPU time")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22))


if __name__ == "__main__":
    main()
