"""Greedy generation with a small random Inkling on a paged `QSAPagedCache`.

A ragged, left-padded batch; prints the generated ids, tokens/s and the cache's memory stats, then checks every
row against transformers' own `InklingForCausalLM` holding the same weights, on that row alone, unpadded, fp32 on
the CPU. Prints one OK line, or the first differing token of each row and exits with status 1.

    python examples/generate_inkling.py [--device cuda] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers
from transformers import InklingTextConfig

from hf_qsa_cache import QSAPagedCache
from modeling import InklingForCausalLM
from verdict import compare, greedy, transformers_twin, unpadded


def small_config() -> InklingTextConfig:
    return InklingTextConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=6,
        layer_types=["hybrid_sliding"] * 5 + ["hybrid"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        swa_num_attention_heads=8, swa_num_key_value_heads=4, swa_head_dim=16,
        sliding_window_size=16, d_rel=8, rel_extent=64, log_scaling_n_floor=32,
        conv_kernel_size=4, intermediate_size=256, moe_intermediate_size=64,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, dense_mlp_idx=1,
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = small_config()
    model = InklingForCausalLM(config).to(args.device).eval()

    lengths = [40, 7, 23, 64]
    batch = len(lengths)
    width = max(lengths)
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, n in enumerate(lengths):
        input_ids[i, width - n:] = torch.randint(3, config.vocab_size, (n,))
        attention_mask[i, width - n:] = 1
    input_ids, attention_mask = input_ids.to(args.device), attention_mask.to(args.device)

    cache = QSAPagedCache(config, max_batch_size=batch, max_cache_len=width + args.new_tokens, block_size=16)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache,
                             max_new_tokens=args.new_tokens, do_sample=False)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

    generated = out[:, width:]
    for i, row in enumerate(generated.tolist()):
        print(f"row {i} (prompt {lengths[i]:>2} tokens): {row}")
    print(f"{generated.numel() / seconds:.1f} tokens/s ({generated.numel()} tokens in {seconds:.2f} s, "
          f"prefill included)")
    print(json.dumps(cache.memory_stats(), indent=2))

    twin = transformers_twin(model, transformers.InklingForCausalLM)
    want = [greedy(twin, args.new_tokens, row) for row in unpadded(input_ids, attention_mask)]
    compare("inkling", generated.tolist(), want,
            "transformers' InklingForCausalLM (same weights, fp32, CPU) on each row alone, unpadded")


if __name__ == "__main__":
    main()
