"""Incomplete or extra checkpoints load into our classes as into transformers' own, both families.

Every checkpoint here is written by transformers' class (`save_pretrained` into tmp_path, tiny configs) and
then loaded by transformers' class and by ours doing the same thing. Both must give the same
``output_loading_info`` (missing, unexpected and mismatched keys), log the same load report on the
``transformers`` logger, emit the same Python warning categories, raise the same exception type where
transformers raises, and load the same values wherever the checkpoint has them:

* a base-model checkpoint (``*TextModel``) loaded into ``*ForCausalLM``: the head is missing, initialised and
  reported (Qwen4Exp with ``tie_word_embeddings`` ties it instead; Inkling never ties);
* a causal-LM checkpoint loaded into the text model: the head is reported unexpected;
* a checkpoint with no weight of the model at all: every weight is initialised and reported;
* single weights dropped: each is initialised and reported;
* a model whose tied head was not saved, reloaded tied and untied;
* a checkpoint weight the model does not have: reported;
* a weight of another shape: transformers' RuntimeError, or with ``ignore_mismatched_sizes`` its report.

The one case our classes refuse where transformers only warns (weights present under names not converted
while the same module's parameters are missing) is in ``test_checkpoints.py``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import helpers.inkling as ih
import helpers.qwen4 as qh
from helpers.checkpoints import read_checkpoint as _checkpoint
from helpers.checkpoints import rewrite_checkpoint as _rewrite
import torch
import transformers

import modeling
from modeling import modeling_inkling
from modeling.checkpoints import StrictLoadingMixin

FAMILIES = ["qwen4_exp", "inkling"]
OURS = {
    ("qwen4_exp", "ForCausalLM"): modeling.Qwen4ExpForCausalLM,
    ("qwen4_exp", "TextModel"): modeling.Qwen4ExpTextModel,
    ("inkling", "ForCausalLM"): modeling.InklingForCausalLM,
    ("inkling", "TextModel"): modeling_inkling.InklingTextModel,
}


# ----------------------------------------------------------------------------- helpers
def _config(family, **overrides):
    return qh.tiny_config(**overrides) if family == "qwen4_exp" else ih.make_config(**overrides)


def _pair(family, kind):
    """(our class, transformers' class of the same name)."""
    ours = OURS[family, kind]
    return ours, getattr(transformers, ours.__name__)


def _save_upstream(family, kind, path, seed=0, **overrides):
    """transformers' ``kind`` class with random weights, saved to ``path``; returns its state dict."""
    torch.manual_seed(seed)
    model = _pair(family, kind)[1](_config(family, **overrides)).eval()
    qh.randomize_(model, seed)
    model.save_pretrained(path)
    return model.state_dict()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append((record.name, record.levelname, record.getMessage()))


@contextlib.contextmanager
def _watching():
    """What a load says: WARNING+ records of the ``transformers`` loggers, and the Python warnings raised."""
    handler = _Records()
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    said = {"log": handler.records}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield said
    finally:
        root.removeHandler(handler)
    said["warnings"] = sorted({w.category.__name__ for w in caught})


def _load(cls, path, **kwargs):
    """(model or None, loading info or the exception raised, log records, warning categories). Seeded: what the
    checkpoint lacks is initialised from the same random stream for either class."""
    torch.manual_seed(0)
    with _watching() as said:
        try:
            model, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
        except Exception as error:  # noqa: BLE001 - compared with transformers' own outcome below
            model, info = None, error
    return model, info, said["log"], said["warnings"]


def _load_both(family, kind, path, **kwargs):
    """Load ``path`` with our class and transformers'; assert that both report, log and warn the same, and
    load the same values wherever the checkpoint has them. Returns (ours, theirs, loading info)."""
    ours_cls, their_cls = _pair(family, kind)
    theirs, their_info, their_log, their_warnings = _load(their_cls, path, **kwargs)
    ours, our_info, our_log, our_warnings = _load(ours_cls, path, **kwargs)
    if isinstance(their_info, Exception):
        assert isinstance(our_info, type(their_info)), f"transformers raised {their_info!r}, ours {our_info!r}"
        return None, None, their_info
    assert not isinstance(our_info, Exception), f"ours raised where transformers loads: {our_info!r}"
    assert our_info == their_info
    assert _lines(our_log) == _lines(their_log)  # the same load report, on the same logger, at the same level
    assert our_warnings == their_warnings
    # Loaded where present, and initialised where missing exactly as transformers initialises: every weight equal.
    mine, upstream = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == upstream.keys()
    for key, value in upstream.items():
        assert torch.equal(mine[key], value), key
    return ours, theirs, their_info


def _lines(log):
    """Log records with their lines sorted (the report lists keys in set order)."""
    return [(name, level, sorted(message.splitlines())) for name, level, message in log]


# ----------------------------------------------------------------------------- base checkpoint -> causal LM
@pytest.mark.parametrize("family, tied", [
    pytest.param("qwen4_exp", False, id="qwen4_exp-untied"),
    pytest.param("qwen4_exp", True, id="qwen4_exp-tied"),
    pytest.param("inkling", False, id="inkling"),
])
def test_base_checkpoint_loads_into_causal_lm(tmp_path, family, tied):
    overrides = {"tie_word_embeddings": True} if tied else {}
    saved = _save_upstream(family, "TextModel", tmp_path, seed=1, **overrides)
    ours, _, info = _load_both(family, "ForCausalLM", tmp_path, **overrides)
    assert info["missing_keys"] == (set() if tied else {"lm_head.weight"})
    assert not info["unexpected_keys"]
    state = ours.state_dict()
    assert all(torch.equal(state[f"model.{key}"], value) for key, value in saved.items())
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_checkpoint_reports_its_head_unexpected_in_the_text_model(tmp_path, family):
    _save_upstream(family, "ForCausalLM", tmp_path, seed=2)
    _, _, info = _load_both(family, "TextModel", tmp_path)
    assert info["unexpected_keys"] == {"lm_head.weight"} and not info["missing_keys"]


# ----------------------------------------------------------------------------- built from a config
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dispatch", ["custom-code", "library-code"])
def test_seeded_build_from_config_equals_transformers(family, dispatch, monkeypatch):
    """A model built from a config under a seed has transformers' weights under that seed. transformers skips
    `_init_weights` on a custom-code module without parameters of its own (our short convolution wrapper) but
    runs it on every module of a library class: ours must give transformers' values either way."""
    ours_cls, their_cls = _pair(family, "ForCausalLM")
    config = _config(family)
    torch.manual_seed(8)
    theirs = their_cls(config)
    if dispatch == "library-code":
        # every class of ours (the text model's own post_init initialises first) dispatched as transformers' own
        monkeypatch.setattr(StrictLoadingMixin, "is_custom_code", classmethod(lambda cls: False), raising=False)
    torch.manual_seed(8)
    ours = ours_cls(config)
    mine, upstream = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == upstream.keys()
    for key, value in upstream.items():
        assert torch.equal(mine[key], value), key


# ----------------------------------------------------------------------------- missing weights
@pytest.mark.parametrize("family", FAMILIES)
def test_every_weight_missing_is_initialised_and_reported(tmp_path, family):
    _save_upstream(family, "ForCausalLM", tmp_path, seed=3)
    _rewrite(tmp_path, {"tensor": torch.tensor([1, 2])})  # no weight of the model left
    ours, _, info = _load_both(family, "ForCausalLM", tmp_path)
    assert info["unexpected_keys"] == {"tensor"}
    # Every parameter and persistent buffer reported missing (a tied head counts, its embedding being missing too).
    persistent = set(ours.state_dict())
    assert info["missing_keys"] == persistent
    with torch.no_grad():
        assert torch.isfinite(ours(torch.tensor([[3, 4, 5]])).logits).all()


@pytest.mark.parametrize("family, dropped", [
    ("qwen4_exp", "model.layers.3.self_attn.indexer.index_qk_proj.weight"),
    ("qwen4_exp", "model.layers.0.linear_attn.A_log"),
    ("qwen4_exp", "lm_head.weight"),  # untied here: the head must come from the checkpoint
    ("inkling", "model.layers.4.mlp.experts.down_proj"),
    ("inkling", "model.layers.0.mlp.down_proj.weight"),
    ("inkling", "model.layers.1.self_attn.k_sconv.conv1d.weight"),
    ("inkling", "lm_head.weight"),
])
def test_missing_weight_is_initialised_and_reported(tmp_path, family, dropped):
    _save_upstream(family, "ForCausalLM", tmp_path, seed=4)
    tensors = _checkpoint(tmp_path)
    del tensors[dropped]
    _rewrite(tmp_path, tensors)
    _, _, info = _load_both(family, "ForCausalLM", tmp_path)
    assert info["missing_keys"] == {dropped} and not info["unexpected_keys"]


# ----------------------------------------------------------------------------- tied heads not saved
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("reload_tied", [True, False], ids=["reload-tied", "reload-untied"])
def test_model_saved_with_tied_head_reloads(tmp_path, family, reload_tied):
    """Saved with ``tie_word_embeddings=True``: Qwen4Exp ties its head and leaves it out of the checkpoint
    (reloaded untied, the head is missing); Inkling never ties (no tied keys, as upstream), so its head is saved."""
    _save_upstream(family, "ForCausalLM", tmp_path, seed=5, tie_word_embeddings=True)
    head_saved = "lm_head.weight" in _checkpoint(tmp_path)
    assert head_saved == (family == "inkling")
    ours, _, info = _load_both(family, "ForCausalLM", tmp_path, tie_word_embeddings=reload_tied)
    head_missing = not head_saved and not reload_tied
    assert info["missing_keys"] == ({"lm_head.weight"} if head_missing else set())
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (family == "qwen4_exp" and reload_tied)


# ----------------------------------------------------------------------------- extra and mismatched weights
@pytest.mark.parametrize("family", FAMILIES)
def test_unused_checkpoint_weight_is_reported(tmp_path, family):
    _save_upstream(family, "ForCausalLM", tmp_path, seed=6)
    tensors = _checkpoint(tmp_path)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    _rewrite(tmp_path, tensors)
    _, _, info = _load_both(family, "ForCausalLM", tmp_path)
    assert info["unexpected_keys"] == {"model.layers.0.mlp.extra.weight"} and not info["missing_keys"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ignore", [False, True], ids=["refused", "ignore_mismatched_sizes"])
def test_weight_of_another_shape(tmp_path, family, ignore):
    _save_upstream(family, "ForCausalLM", tmp_path, seed=7)
    tensors = _checkpoint(tmp_path)
    key = "model.layers.1.post_attention_layernorm.weight"
    if family == "qwen4_exp":
        key = "model.layers.1.self_attn.o_proj.weight"
    tensors[key] = torch.ones(tensors[key].shape[0], 3)
    _rewrite(tmp_path, tensors)
    _, _, info = _load_both(family, "ForCausalLM", tmp_path, ignore_mismatched_sizes=ignore)
    if not ignore:
        assert isinstance(info, RuntimeError)  # transformers refuses; so do we (naming the weight)
        with pytest.raises(ValueError, match="of another shape") as error:
            _pair(family, "ForCausalLM")[0].from_pretrained(tmp_path)
        assert f"\n  {key}" in str(error.value)
        return
    assert {k for k, *_ in info["mismatched_keys"]} == {key} and not info["missing_keys"]
