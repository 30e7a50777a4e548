"""Tiny Qwen4Exp configs, weight randomisation and the per-row upstream reference."""

from __future__ import annotations

import copy

import torch
import transformers
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

from modeling import Qwen4ExpForCausalLM

EOS = 1


def tiny_config(**overrides) -> Qwen4ExpTextConfig:
    """QSA layers whose selection is active for prompts of ~20+ tokens (budget 8, ratio 2: 4 groups).

    16 index heads make an all-zero relu score (a tie whose order upstream leaves to torch.topk) rare,
    so row-by-row comparisons test the selection rather than tie-breaking.
    """
    kwargs = dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4,
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        hc_count=2, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=16, ple_conv_kernel_size=2, ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=31, make_ngram_vocab_size_divisible_by=8,
        indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2,
        eos_token_id=EOS, pad_token_id=0, bos_token_id=None, output_gate_type="sigmoid",
        max_position_embeddings=512,
    )
    kwargs.update(overrides)
    return Qwen4ExpTextConfig(**kwargs)



# Few index heads: a group's index score, the sum over heads of relu(q . k), is exactly zero whenever every head's
# product is negative, which few heads make common, and such zeros tie at the top-k cut (where transformers keeps
# the groups its torch.topk keeps). By name: 4 heads with the index geometry of examples/generate_qwen4_exp.py's
# small_config (budget 32, ratio 4: 8 groups kept, active from 36 tokens); 2 heads with tiny_config's.
FEW_INDEX_HEADS = {
    "4-index-heads": dict(indexer_n_heads=4, indexer_budget=32, indexer_compress_ratio=4),
    "2-index-heads": dict(indexer_n_heads=2),
}


def few_index_heads_config(name: str, **overrides) -> Qwen4ExpTextConfig:
    """`tiny_config` with one of the `FEW_INDEX_HEADS` index settings."""
    return tiny_config(**{**FEW_INDEX_HEADS[name], **overrides})

def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> None:
    """Every float parameter random (upstream init zeroes norms and the PLE conv, which would hide bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.dtype.is_floating_point:
                continue
            scale = std
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
                continue
            if "norm" in name:
                scale = 0.2
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def own_config(config):
    """A copy of ``config`` for our model: building transformers' model writes its default experts
    implementation into the config it is given, which ours would then take for the user's choice."""
    own = copy.deepcopy(config)
    own._experts_implementation_internal = None
    return own


def make_pair(config=None, seed: int = 0):
    """(upstream model, our model) with identical weights, fp32, eval."""
    config = config or tiny_config()
    torch.manual_seed(seed)
    ref = transformers.Qwen4ExpForCausalLM(config).eval()
    randomize_(ref, seed)
    ours = Qwen4ExpForCausalLM(own_config(config)).eval()
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected
    return ref, ours


def left_pad(prompts: list[list[int]], pad: int = 0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def random_prompts(lengths, vocab=96, seed=0, avoid=(0, EOS)):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(2, vocab, (n,), generator=gen).tolist()
        out.append([t for t in ids if t not in avoid])
    return out


def upstream_generate(ref, prompt: list[int], max_new_tokens: int, **kwargs):
    """Upstream on one row alone, unpadded: (new tokens, per-step logits [steps, vocab])."""
    out = ref.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
        pad_token_id=0, eos_token_id=None, **kwargs,
    )
    return out.sequences[0, len(prompt):], torch.stack([l[0] for l in out.logits])


def collect_results(manager, count: int, timeout: float = 60) -> dict:
    """The first ``count`` finished results a continuous-batching manager returns, by request id (fails if
    one does not come within ``timeout`` seconds)."""
    results = {}
    while len(results) < count:
        result = manager.get_result(timeout=timeout)
        assert result is not None, f"{len(results)} of {count} results came within {timeout} s"
        results[result.request_id] = result
    return results
