"""Tiny Inkling configs, a model pair (transformers' class and ours) with the same weights, prompts and the
per-row upstream reference: sliding layers evict (window 6 < prompts + generation), full and sliding layers
have different KV-head counts and head dims, log scaling is on (n_floor 4), both MLP kinds appear."""

from __future__ import annotations

import torch
from transformers import InklingForCausalLM as UpstreamInkling
from transformers import InklingTextConfig

from modeling import InklingForCausalLM

from .qwen4 import own_config

WINDOW = 6
KERNEL = 4
BLOCK = 4
PROMPT_LENS = [9, 3, 14, 6]  # two prompts longer than the window


def make_config(**overrides) -> InklingTextConfig:
    kwargs = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=5,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        sliding_window_size=WINDOW, d_rel=4, rel_extent=12,
        log_scaling_n_floor=4, log_scaling_alpha=0.5, conv_kernel_size=KERNEL,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, dense_mlp_idx=2, logits_mup_width_multiplier=1.0,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )
    kwargs.update(overrides)
    return InklingTextConfig(**kwargs)


def make_pair(config, seed=0, std=0.3):
    torch.manual_seed(seed)
    upstream = UpstreamInkling(config).eval()
    with torch.no_grad():
        for name, p in upstream.named_parameters():
            if "norm" not in name and "global_scale" not in name:
                p.normal_(0.0, std)  # large enough that logits are far from flat
    ours = InklingForCausalLM(own_config(config)).eval()
    ours.load_state_dict(upstream.state_dict(), strict=True)
    return upstream, ours


def make_prompts(lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g) for n in lens]


def left_pad(rows):
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = r
        mask[i, L - len(r):] = 1
    return ids, mask


def greedy(model, ids, mask=None, n=12, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **kwargs)


_reference_cache: dict = {}


def upstream_row(upstream, row, n):
    """Upstream greedy generation on one unpadded row (memoized across tests)."""
    key = (upstream, tuple(row.tolist()), n)  # the object, not its id (ids of freed models are reused)
    if key not in _reference_cache:
        out = greedy(upstream, row[None], n=n)
        _reference_cache[key] = (out.sequences[0, len(row):], torch.stack([s[0] for s in out.logits]))
    return _reference_cache[key]


def assert_rows_match_upstream(upstream, rows, out, n):
    L = out.sequences.shape[1] - n
    for i, row in enumerate(rows):
        ref_tokens, ref_logits = upstream_row(upstream, row, n)
        got_logits = torch.stack([s[i] for s in out.logits])
        assert torch.equal(out.sequences[i, L:], ref_tokens), f"row {i}: {out.sequences[i, L:]} vs {ref_tokens}"
        torch.testing.assert_close(got_logits, ref_logits, atol=1e-4, rtol=0, msg=lambda m: f"row {i}: {m}")
