"""The released depths and layer schedules, at tiny widths, against transformers' own classes (CPU, fp32).

The other tests run 4-5 layers. Users run Qwen4Exp at 40 layers (every fourth a QSA layer: 30 GatedDeltaNet
+ 10 QSA) and Inkling at 66 (every sixth full attention: 55 sliding + 11 full, every MLP sparse with two
shared experts). The schedules come from transformers' configs themselves (their default ``layer_types``),
so a store, table or graph that assumed few layers, or one layer kind's count, would show here.

The checkpoint is written by transformers' class and loaded with our ``from_pretrained``, as users load it.
Each row of a ragged left-padded batch must generate what upstream generates on that row alone, unpadded,
with QSA selection active (prompts of more groups than the budget keeps) and Inkling's windows evicting.
"""

from __future__ import annotations

import pytest
import helpers.inkling as inkling
import torch
import transformers
from helpers.qwen4 import left_pad, random_prompts, randomize_, tiny_config, upstream_generate
from transformers import InklingTextConfig
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

from hf_qsa_cache import QSAPagedCache
from modeling import InklingForCausalLM, Qwen4ExpForCausalLM

NEW = 6


def released_schedule(config_class) -> list[str]:
    """The layer kinds of the released model, in order, as transformers' config builds them by default."""
    return list(config_class().layer_types)


def qwen4_exp_released_depth():
    layer_types = released_schedule(Qwen4ExpTextConfig)
    assert len(layer_types) == 40 and layer_types.count("indexed_attention") == 10
    config = tiny_config(num_hidden_layers=len(layer_types), layer_types=layer_types, ple_layer_ids=[1, 38])
    torch.manual_seed(0)
    upstream = transformers.Qwen4ExpForCausalLM(config).eval()
    randomize_(upstream, seed=0, std=0.2)
    return upstream


def inkling_released_depth():
    layer_types = released_schedule(InklingTextConfig)
    assert len(layer_types) == 66 and layer_types.count("hybrid") == 11
    config = inkling.make_config(num_hidden_layers=len(layer_types), layer_types=layer_types,
                                 dense_mlp_idx=None, mlp_layer_types=["sparse"] * len(layer_types),
                                 n_shared_experts=2)
    upstream, _ = inkling.make_pair(config, std=0.2)
    return upstream


CASES = {
    # name: (upstream builder, our class, prompt lengths)
    "qwen4_exp": (qwen4_exp_released_depth, Qwen4ExpForCausalLM, [27, 9, 21]),
    "inkling": (inkling_released_depth, InklingForCausalLM, [14, 4, 9]),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_released_depth_matches_upstream_per_row(family, tmp_path):
    build_upstream, Ours, lengths = CASES[family]
    upstream = build_upstream()
    upstream.save_pretrained(tmp_path)
    ours = Ours.from_pretrained(tmp_path).eval()
    config = ours.config
    assert config.num_hidden_layers in (40, 66)

    vocab = config.vocab_size
    prompts = random_prompts(lengths, vocab=vocab, seed=3)
    if family == "qwen4_exp":
        # Selection active: the longest prompt holds more complete groups than the budget keeps.
        assert max(lengths) // config.indexer_compress_ratio > config.indexer_budget // config.indexer_compress_ratio
    else:
        assert max(lengths) > config.sliding_window_size  # sliding layers evict
    ids, mask = left_pad(prompts)
    cache = QSAPagedCache(config, max_batch_size=len(prompts), max_cache_len=ids.shape[1] + NEW, block_size=4)
    with torch.no_grad():
        out = ours.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                            output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        want = [upstream_generate(upstream, prompt, NEW) for prompt in prompts]
    for row, (tokens, logits) in enumerate(want):
        assert out.sequences[row, ids.shape[1]:].tolist() == tokens.tolist(), f"row {row}"
        mine = torch.stack([step[row] for step in out.logits])
        torch.testing.assert_close(mine, logits, atol=1e-4, rtol=1e-4)
    assert len(set(out.sequences[:, ids.shape[1]:].flatten().tolist())) > 2, "degenerate model output"
