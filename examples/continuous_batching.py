"""Continuous batching with transformers' API on a small random Qwen4Exp (no downloads).

A stream of requests of mixed lengths runs through `model.generate_batch` (one background loop: rows
that finish give their blocks back, new requests start at once, prompts are prefilled in chunks between
decode steps). Prints throughput, then checks every request against transformers' own
`Qwen4ExpForCausalLM` with the same weights on its prompt alone (fp32, CPU; in another dtype, against our
`generate()` on the prompt alone): one OK line, or the first differing token of each request and exit status 1.

    python examples/continuous_batching.py [--requests 24] [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
from generate_qwen4_exp import small_config
from transformers import ContinuousBatchingConfig, GenerationConfig
from verdict import compare, greedy, transformers_twin

from modeling import Qwen4ExpForCausalLM


def alone(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], str]:
    """The reference greedy tokens of each prompt alone (a plain `generate()` of one unpadded row), and what gave
    them: transformers' own class with ``model``'s weights for an fp32 model, otherwise ``model`` itself."""
    if next(model.parameters()).dtype == torch.float32:
        twin = transformers_twin(model, transformers.Qwen4ExpForCausalLM)
        reference = "transformers' Qwen4ExpForCausalLM (same weights, fp32, CPU) on each prompt alone"
    else:
        twin, reference = model, "our generate() on each prompt alone"
    device = next(twin.parameters()).device
    return [greedy(twin, new_tokens, torch.tensor([p], device=device)) for p in prompts], reference


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rows", type=int, default=8, help="requests in flight (max_requests_per_batch)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(small_config()).to(args.device, getattr(torch, args.dtype)).eval()
    # No eos: every request generates its 32 tokens (generate() would otherwise fall back to the config's eos).
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 160, (args.requests,), generator=gen)]
    generation_config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    config = ContinuousBatchingConfig(page_size=16, max_requests_per_batch=args.rows, max_batch_tokens=256)

    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config, config, progress_bar=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in results.values())
    print(f"{len(results)} requests, {tokens} new tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tokens/s "
          f"({args.rows} in flight)")

    got = [results[f"req_{i}"].generated_tokens if f"req_{i}" in results else [] for i in range(len(prompts))]
    compare("continuous batching", got, *alone(model, prompts, generation_config.max_new_tokens))


if __name__ == "__main__":
    main()
