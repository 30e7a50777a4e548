"""Generate with a small random Qwen4Exp on QSAPagedCache (no downloads), and check the tokens.

A ragged, left-padded batch; prints the generated ids, tokens/s and the cache's memory stats. Then every row is
checked: in fp32, against transformers' own `Qwen4ExpForCausalLM` holding the same weights, on that row alone,
unpadded, on the CPU; in another dtype (no exact reference there), against our `generate()` on that row alone.
Prints one OK line, or the first differing token of each row and exits with status 1.

    python examples/generate_qwen4_exp.py [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

from hf_qsa_cache import QSAPagedCache
from modeling import Qwen4ExpForCausalLM
from verdict import compare, greedy, transformers_twin, unpadded


def small_config() -> Qwen4ExpTextConfig:
    return Qwen4ExpTextConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        hc_count=2, hc_lowrank=16, ple_layer_ids=[1], ple_embed_dim=32, ple_conv_kernel_size=4, ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=1009, make_ngram_vocab_size_divisible_by=8,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=32, indexer_compress_ratio=4,
        eos_token_id=1, pad_token_id=0, output_gate_type="sigmoid",
    )


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(small_config()).to(args.device, dtype).eval()
    lengths = [70, 23, 48]  # ragged rows, left-padded; 70 tokens = 17 groups > 8 kept, so selection is active
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, n in enumerate(lengths):
        input_ids[i, width - n:] = torch.randint(2, 512, (n,))
        attention_mask[i, width - n:] = 1

    cache = QSAPagedCache(config=model.config, max_batch_size=len(lengths), max_cache_len=width + args.new_tokens,
                          block_size=16)
    start = time.perf_counter()
    out = model.generate(input_ids.to(args.device), attention_mask=attention_mask.to(args.device),
                         past_key_values=cache, max_new_tokens=args.new_tokens, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    elapsed = time.perf_counter() - start
    new = out[:, width:]
    for i, row in enumerate(new.tolist()):
        print(f"row {i} (prompt {lengths[i]} tokens): {row}")
    print(f"{new.numel() / elapsed:.1f} tokens/s ({elapsed:.2f} s, device {args.device}, {args.dtype})")
    stats = cache.memory_stats()
    for name, size in stats["bytes"].items():
        print(f"  {name:18s} {size / 1024:9.1f} KiB")
    for name, table in stats["tables"].items():
        print(f"  table {name}: {table}")

    rows = unpadded(input_ids, attention_mask)
    if dtype == torch.float32:
        reference = "transformers' Qwen4ExpForCausalLM (same weights, fp32, CPU) on each row alone, unpadded"
        twin = transformers_twin(model, transformers.Qwen4ExpForCausalLM)
        want = [greedy(twin, args.new_tokens, row) for row in rows]
    else:
        reference = f"our generate() on each row alone, unpadded ({args.dtype})"
        want = [greedy(model, args.new_tokens, row) for row in rows]
    compare("qwen4_exp", new.tolist(), want, reference)


if __name__ == "__main__":
    main()
