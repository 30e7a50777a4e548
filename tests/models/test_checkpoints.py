"""Checkpoints saved by transformers' own classes load into ours as into theirs.

transformers saves Qwen4Exp experts one tensor per expert and the n-gram table in shards, and
converts back on load; our classes must get the same conversions, under sharding, bf16 and
accelerate disk offload. Weights a checkpoint lacks are initialised and reported as transformers does
(`test_loading_rules.py`); what raises is what transformers refuses (a conversion that fails, a weight
of another shape) and, beyond transformers, weights present under a name that was not converted while
the same module's parameters are missing. MTP heads and vision/audio towers are not part of the text
model; Inkling's MTP layers load into the drafting model (`modeling/inkling_mtp.py`) in every layout
transformers' `MtpModel` loads.
"""

from __future__ import annotations

import glob

import re

import pytest
import helpers.inkling as inkling
import torch
import transformers
import transformers.conversion_mapping as conversion_mapping
from helpers.checkpoints import read_checkpoint as _checkpoint
from helpers.checkpoints import rewrite_checkpoint as _rewrite
from helpers.qwen4 import left_pad, random_prompts, randomize_, tiny_config, upstream_generate
from transformers import InklingTextConfig, Qwen4ExpTextConfig
from transformers.generation.candidate_generator import MTPCandidateGenerator
from transformers.modeling_layers import MtpModel

from hf_qsa_cache import QSAPagedCache
from modeling import InklingForCausalLM, Qwen4ExpForCausalLM
from modeling.checkpoints import IGNORED_CHECKPOINT_KEYS, CheckpointLoadingError
from modeling.inkling_mtp import InklingMtpModel

NEW = 8
FAMILIES = ["qwen4_exp", "inkling"]
OURS = {"qwen4_exp": Qwen4ExpForCausalLM, "inkling": InklingForCausalLM}


# ----------------------------------------------------------------------------- helpers
def _qwen4_upstream(seed=0, **overrides):
    # Hyper-connections 3 wide, PLE on layer 1, QSA budget 8 / ratio 2 (selection active from ~20 tokens).
    config = tiny_config(hc_count=3, **overrides)
    torch.manual_seed(seed)
    ref = transformers.Qwen4ExpForCausalLM(config).eval()
    randomize_(ref, seed)
    return ref


def _upstream(family, seed=0):
    if family == "qwen4_exp":
        return _qwen4_upstream(seed)
    upstream, _ = inkling.make_pair(inkling.make_config(num_mtp_layers=1), seed=seed)
    return upstream


def _prompts(family, seed):
    """Ragged left-padded batch: (ids, mask)."""
    if family == "qwen4_exp":
        return left_pad(random_prompts([26, 11, 21], seed=seed))
    return inkling.left_pad(inkling.make_prompts([13, 5, 9], seed=seed))


def _generate(model, ids, mask):
    cache = QSAPagedCache(model.config, max_batch_size=ids.shape[0], max_cache_len=ids.shape[1] + NEW, block_size=4)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def _assert_same_weights(ours, reference_state):
    state = ours.state_dict()
    assert state.keys() == reference_state.keys()
    for key, value in reference_state.items():
        assert torch.equal(state[key], value.to(state[key].dtype)), key


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("max_shard_size", [None, "50KB"])
def test_qwen4_upstream_checkpoint_generates_like_upstream(tmp_path, max_shard_size):
    ref = _qwen4_upstream(seed=3)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    ref.save_pretrained(tmp_path, **kwargs)
    saved = _checkpoint(tmp_path)
    # Upstream's on-disk layout, which needs converting: per-expert tensors and n-gram shards.
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in saved
    assert "model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight" in saved
    assert "model.layers.0.mlp.experts.gate_up_proj" not in saved
    if max_shard_size:
        assert len(glob.glob(str(tmp_path / "*.safetensors"))) > 3

    ours = Qwen4ExpForCausalLM.from_pretrained(tmp_path)
    _assert_same_weights(ours, ref.state_dict())

    prompts = random_prompts([26, 11, 21], seed=4)
    assert max(map(len, prompts)) // 2 > 8 // 2  # more closed groups than the top-k keeps
    ids, mask = left_pad(prompts)
    tokens, logits = _generate(ours, ids, mask)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = upstream_generate(ref, prompt, NEW)
        assert tokens[i].tolist() == ref_tokens.tolist(), f"row {i}"
        torch.testing.assert_close(logits[i], ref_logits, atol=2e-4, rtol=0)
    assert len(set(tokens.flatten().tolist())) > 3, "degenerate model output"


@pytest.mark.parametrize("max_shard_size", [None, "50KB"])
def test_inkling_upstream_checkpoint_generates_like_upstream(tmp_path, max_shard_size):
    upstream = _upstream("inkling", seed=5)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    upstream.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        assert len(glob.glob(str(tmp_path / "*.safetensors"))) > 3

    ours = InklingForCausalLM.from_pretrained(tmp_path)
    _assert_same_weights(ours, upstream.state_dict())

    rows = inkling.make_prompts([13, 5, 9], seed=6)
    ids, mask = inkling.left_pad(rows)
    cache = QSAPagedCache(ours.config, max_batch_size=len(rows), max_cache_len=ids.shape[1] + NEW, block_size=4)
    out = inkling.greedy(ours, ids, mask, n=NEW, past_key_values=cache)
    for i, row in enumerate(rows):
        ref = inkling.greedy(upstream, row[None], n=NEW)
        assert out.sequences[i, ids.shape[1]:].tolist() == ref.sequences[0, len(row):].tolist(), f"row {i}"
        torch.testing.assert_close(torch.stack([s[i] for s in out.logits]), torch.stack([s[0] for s in ref.logits]),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["upstream", "fused"])
def test_qwen4_tied_embeddings_load_in_either_layout(tmp_path, layout):
    """Fused experts / whole n-gram table load as they are; a tied lm_head is not reported missing."""
    ref = _qwen4_upstream(seed=7, tie_word_embeddings=True)
    ref.save_pretrained(tmp_path)
    assert "lm_head.weight" not in _checkpoint(tmp_path)
    if layout == "fused":
        state = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
        _rewrite(tmp_path, state)
    ours = Qwen4ExpForCausalLM.from_pretrained(tmp_path)
    _assert_same_weights(ours, ref.state_dict())
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_qwen4_saves_upstream_layout(tmp_path):
    ref = _qwen4_upstream(seed=8)
    ref.save_pretrained(tmp_path / "upstream")
    ours = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "upstream")
    ours.save_pretrained(tmp_path / "ours")
    assert _checkpoint(tmp_path / "ours").keys() == _checkpoint(tmp_path / "upstream").keys()
    back, info = transformers.Qwen4ExpForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _assert_same_weights(back, ref.state_dict())


# ----------------------------------------------------------------------------- offload, dtype
@pytest.mark.parametrize("family", FAMILIES)
def test_disk_offloaded_load_generates_like_in_memory(tmp_path, family):
    _upstream(family, seed=9).save_pretrained(tmp_path / "ckpt")
    cls = OURS[family]
    in_memory = cls.from_pretrained(tmp_path / "ckpt")
    ids, mask = _prompts(family, seed=10)
    expected, expected_logits = _generate(in_memory, ids, mask)

    device_map = {f"model.{name}": "cpu" for name, _ in in_memory.model.named_children() if name != "layers"}
    device_map["lm_head"] = "cpu"
    for i in range(in_memory.config.num_hidden_layers):
        device_map[f"model.layers.{i}"] = "disk" if i % 2 else "cpu"
    offloaded = cls.from_pretrained(tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "offload")
    assert offloaded.model.layers[3].mlp.experts.down_proj.device.type == "meta"  # really runs from disk
    if family == "qwen4_exp":  # fused experts are not in the checkpoint as such: converted into the offload folder
        assert any(path.name.startswith("model.layers.3.mlp.experts.") for path in (tmp_path / "offload").iterdir())
    tokens, logits = _generate(offloaded, ids, mask)
    assert tokens.tolist() == expected.tolist()
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_load_is_complete(tmp_path, family):
    _upstream(family, seed=11).save_pretrained(tmp_path)
    ours = OURS[family].from_pretrained(tmp_path, dtype=torch.bfloat16)
    upstream_class = getattr(transformers, OURS[family].__name__)
    reference = upstream_class.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert ours.model.layers[-1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert ours.lm_head.weight.dtype == torch.bfloat16
    # Same dtypes as upstream's load (Inkling keeps its short convs in fp32), same values.
    assert {k: v.dtype for k, v in ours.state_dict().items()} == {k: v.dtype for k, v in reference.state_dict().items()}
    _assert_same_weights(ours, reference.state_dict())


# ----------------------------------------------------------------------------- what raises
@pytest.mark.parametrize("dropped, named", [
    pytest.param("model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
                 id="one-expert-of-fused-experts"),
    pytest.param("model.layers.0.ple.ple_embedding.ngram_embedding.shard_5.weight",
                 "model.layers.0.ple.ple_embedding.ngram_embedding.weight", id="one-shard-of-ngram-table"),
])
def test_weight_failing_to_convert_raises_naming_it(tmp_path, dropped, named):
    """A conversion missing one of its sources: transformers refuses (RuntimeError, the keys only in its log);
    ours refuses with an error that is that RuntimeError and a ValueError naming the weight."""
    _upstream("qwen4_exp").save_pretrained(tmp_path)
    tensors = _checkpoint(tmp_path)
    del tensors[dropped]
    _rewrite(tmp_path, tensors)
    with pytest.raises(RuntimeError):
        transformers.Qwen4ExpForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="randomly initialised") as error:
        Qwen4ExpForCausalLM.from_pretrained(tmp_path)
    assert isinstance(error.value, RuntimeError) and isinstance(error.value, CheckpointLoadingError)
    assert f"  {named}\n" in str(error.value) + "\n"


def test_unregistered_conversion_raises_naming_the_weights(tmp_path, monkeypatch):
    """The case that bit users: without our registration of transformers' conversions, our class sees the
    per-expert and per-shard names on disk (present, loading nothing) and the fused parameters missing."""
    _upstream("qwen4_exp").save_pretrained(tmp_path)
    monkeypatch.setattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", set())
    with pytest.raises(CheckpointLoadingError, match="names that map to no parameter") as error:
        Qwen4ExpForCausalLM.from_pretrained(tmp_path)
    named = dict(line.strip().split(" <- ") for line in str(error.value).splitlines()[1:])
    saved = sorted(_checkpoint(tmp_path))
    for layer in range(_qwen4_upstream().config.num_hidden_layers):
        # Both fused parameters of the experts module are named with every per-expert tensor of that module.
        experts = f"model.layers.{layer}.mlp.experts."
        per_expert = [key for key in saved if key.startswith(experts)]
        assert len(per_expert) == 3 * 4  # gate, up and down of 4 experts
        for fused in ("gate_up_proj", "down_proj"):
            assert named.pop(experts + fused).split(", ") == per_expert
    table = "model.layers.0.ple.ple_embedding.ngram_embedding."
    assert named.pop(table + "weight").split(", ") == [key for key in saved if key.startswith(table + "shard_")]
    assert not named  # nothing else: every other weight loaded under its own name


@pytest.mark.parametrize("family, weight, stored_as", [
    pytest.param("qwen4_exp", "model.layers.1.self_attn.q_proj.weight",
                 "model.decoder.layers.1.self_attn.q_proj.weight", id="qwen4_exp-other-prefix"),
    pytest.param("inkling", "model.layers.2.self_attn.r_proj.weight",
                 "model.language_model.layers.2.self_attn.r_proj.weight", id="inkling-other-prefix"),
    pytest.param("inkling", "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.kernel",
                 id="inkling-other-leaf"),
    pytest.param("qwen4_exp", "model.layers.0.linear_attn.dt_bias", "model.layers.0.linear_attn.dt_bias.weight",
                 id="qwen4_exp-one-level-down"),
])
def test_weight_under_unconverted_name_raises_naming_both(tmp_path, family, weight, stored_as):
    """transformers reports the parameter missing and the stored name unexpected, and runs the parameter
    randomly initialised; ours refuses, naming both."""
    _upstream(family).save_pretrained(tmp_path)
    tensors = _checkpoint(tmp_path)
    tensors[stored_as] = tensors.pop(weight)
    _rewrite(tmp_path, tensors)
    _, info = getattr(transformers, OURS[family].__name__).from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {weight} and info["unexpected_keys"] == {stored_as}
    with pytest.raises(CheckpointLoadingError) as error:
        OURS[family].from_pretrained(tmp_path)
    assert f"\n  {weight} <- {stored_as}" in str(error.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_and_tower_weights_are_ignored(tmp_path, family):
    upstream = _upstream(family, seed=12)
    upstream.save_pretrained(tmp_path)
    tensors = _checkpoint(tmp_path)
    extra = ["mtp.layers.0.mlp.gate.weight", "mtp.fc.weight", "model.mtp.0.enorm.weight",
             "model.visual.blocks.0.attn.qkv.weight", "model.vision_tower.layers.0.weight",
             "model.audio_tower.norm.weight"]
    tensors.update({key: torch.ones(2, 2) for key in extra})
    _rewrite(tmp_path, tensors)
    ours, info = OURS[family].from_pretrained(tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    _assert_same_weights(ours, upstream.state_dict())
    # One list, shared by both families.
    for cls in OURS.values():
        assert cls._keys_to_ignore_on_load_unexpected == list(IGNORED_CHECKPOINT_KEYS)


# ----------------------------------------------------------------------------- released configs
def _released_config(family):
    if family == "inkling":
        return InklingTextConfig()
    # The defaults leave QSA and PLE unset (a released checkpoint's config sets them): set them at full size.
    return Qwen4ExpTextConfig(indexer_n_heads=32, indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=2048,
                              indexer_compress_ratio=4, ple_layer_ids=[1, 2], eos_token_id=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_matches_upstream_at_released_config(family):
    config = _released_config(family)
    with torch.device("meta"):
        upstream = getattr(transformers, OURS[family].__name__)(config)
        ours = OURS[family](config)
    expected = {key: tuple(value.shape) for key, value in upstream.state_dict().items()}
    assert {key: tuple(value.shape) for key, value in ours.state_dict().items()} == expected
    assert any(".mlp.experts.gate_up_proj" in key for key in expected)


# ----------------------------------------------------------------------------- Inkling MTP checkpoints
def _mtp_layout(key: str, layout: str, num_hidden_layers: int) -> str:
    """The checkpoint name of an `MtpModel` parameter ``key`` in ``layout`` (without the ``model.mtp.`` prefix)."""
    if layout == "numbered-after-main":  # layers.{num_hidden_layers + k}, the block's weights beside eh_proj & co
        key = re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + num_hidden_layers}.", key)
        return key.replace(".mtp_block.", ".")
    if layout == "inkling-release":  # the decoder block under transformer_block, Inkling's names for the rest
        for ours, theirs in ((".mtp_block.", ".transformer_block."), (".eh_proj.", ".input_proj."),
                             (".enorm.", ".embed_norm."), (".hnorm.", ".hidden_norm.")):
            key = key.replace(ours, theirs)
        return re.sub(r"^shared_post_norm\.", "chain_norm.", key)
    return key  # "mtp-model": MtpModel's own parameter names


@pytest.mark.parametrize("layout", ["mtp-model", "numbered-after-main", "inkling-release"])
def test_inkling_mtp_checkpoint_drafts_as_upstream(tmp_path, layout, monkeypatch):
    """A checkpoint of transformers' InklingForCausalLM with two MTP layers (random weights, in each layout
    transformers' `MtpModel` loads): our MTP model loads exactly the saved weights, and generate(use_mtp=True)
    drafts what transformers' MTP drafting drafts, round by round, and gives the tokens of plain greedy."""
    config = inkling.make_config(num_mtp_layers=2, vocab_size=8, chain_hidden_post_norm=layout == "inkling-release")
    upstream, _ = inkling.make_pair(config, seed=1)
    mtp = MtpModel(upstream, 2)
    shared = ("embed_tokens", "shared_head")  # the main model's embedding and head
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if not name.startswith(shared):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "norm" in name else 0.3))
    mtp_weights = {k: v for k, v in mtp.state_dict().items() if not k.startswith(shared)}
    assert any(k.startswith("shared_post_norm.") for k in mtp_weights) == (layout == "inkling-release")
    stored = {f"model.mtp.{_mtp_layout(k, layout, config.num_hidden_layers)}": v for k, v in mtp_weights.items()}
    upstream.save_pretrained(tmp_path, state_dict={**upstream.state_dict(), **stored})

    theirs = transformers.InklingForCausalLM.from_pretrained(tmp_path).eval()
    ours, info = InklingForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # MTP weights are not the main model's
    loaded = InklingMtpModel.from_pretrained(ours.eval(), device_map={"": "cpu"}).state_dict()
    their_loaded = MtpModel.from_pretrained(theirs, device_map={"": "cpu"}).state_dict()
    for key, value in mtp_weights.items():
        assert torch.equal(loaded[key], value) and torch.equal(their_loaded[key], value), key

    drafts = []  # (which model, candidate ids) per round
    get_candidates = MTPCandidateGenerator.get_candidates

    def logged(generator, *args, **kwargs):
        candidates, logits = get_candidates(generator, *args, **kwargs)
        drafts.append((type(generator) is MTPCandidateGenerator, candidates.tolist()))
        return candidates, logits

    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", logged)
    ids = torch.randint(3, 8, (1, 12), generator=torch.Generator().manual_seed(3))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0,
                  eos_token_id=None)
    with torch.no_grad():
        plain = ours.generate(ids, **kwargs)
        drafted = ours.generate(ids, use_mtp=True, **kwargs)
        upstream_drafted = theirs.generate(ids, use_mtp=True, **kwargs)
    assert drafted.tolist() == plain.tolist() == upstream_drafted.tolist()
    ours_drafts = [c for upstream_generator, c in drafts if not upstream_generator]
    assert ours_drafts == [c for upstream_generator, c in drafts if upstream_generator]
    # Some drafts are accepted (fewer rounds than new tokens) and some rejected (more rounds than if each round
    # took all its drafts and one token more: 3 tokens a round after the first).
    assert 16 // 3 + 1 < len(ours_drafts) < 16
