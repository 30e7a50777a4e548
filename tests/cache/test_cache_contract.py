"""What QSAPagedCache promises its callers, for both families (CPU, fp32).

* every constructor argument is validated;
* a model the cache does not fit is refused before any state changes, naming the field and both values;
* a forward that raises leaves the cache as it was before the step (test_fault_injection.py injects a
  fault at every torch call), so the next generate() equals one on a fresh cache;
* generate() refuses what cannot fit before its prefill, and rows without a real token;
* a `cache_implementation` from the generation config does not break generate();
* Qwen4Exp returns hidden states and router logits as upstream does.
"""

from __future__ import annotations

import warnings

import pytest
import helpers.inkling as inkling
import torch
from helpers.qwen4 import left_pad, make_pair, random_prompts, tiny_config

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.generation import _warned_cache_implementation

NEW = 6


@pytest.fixture(scope="module")
def qwen():
    return make_pair(seed=3)


@pytest.fixture(scope="module")
def ink():
    return inkling.make_pair(inkling.make_config(), seed=4)


def _batch(family):
    if family == "qwen4_exp":
        return left_pad(random_prompts([23, 9, 17], seed=11))
    return inkling.left_pad(inkling.make_prompts([11, 4, 8], seed=12))


def _model(family, qwen, ink):
    return (qwen if family == "qwen4_exp" else ink)[1]


def _generate(model, ids, mask, cache, **kwargs):
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits, dim=1)


def _host_state(cache):
    return (list(cache.lengths), cache.num_rows, cache.columns_seen,
            {n: ([list(r) for r in t.rows], list(t.free)) for n, t in cache.tables.items()})


# ----------------------------------------------------------------------------- construction
@pytest.mark.parametrize("kwargs, message", [
    (dict(max_batch_size=0), "max_batch_size must be an integer >= 1, got 0"),
    (dict(max_batch_size=2.0), "max_batch_size must be an integer >= 1, got 2.0"),
    (dict(max_cache_len=True), "max_cache_len must be an integer >= 1, got True"),
    (dict(block_size=0), "block_size must be an integer >= 1, got 0"),
    (dict(num_blocks=1), "num_blocks must be an integer >= 2, got 1"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens must be an integer >= 0, got -1"),
    (dict(device="cpu"), "pass device and dtype together .* got device=cpu, dtype=None"),
    (dict(dtype=torch.float32), "pass device and dtype together .* got device=None, dtype=torch.float32"),
    (dict(device="cpu", dtype=torch.int64), "dtype must be a floating-point torch.dtype .* got torch.int64"),
])
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_constructor_arguments_are_validated(family, kwargs, message):
    config = tiny_config() if family == "qwen4_exp" else inkling.make_config()
    args = dict(max_batch_size=2, max_cache_len=32) | kwargs
    with pytest.raises(ValueError, match=message):
        QSAPagedCache(config, **args)


# ----------------------------------------------------------------------------- the model the cache serves
@pytest.mark.parametrize("family, other, field", [
    ("qwen4_exp", dict(indexer_compress_ratio=4), "indexer_compress_ratio=4, the model has indexer_compress_ratio=2"),
    ("qwen4_exp", dict(num_key_value_heads=1), "num_key_value_heads=1, the model has num_key_value_heads=2"),
    ("qwen4_exp", dict(head_dim=8), "head_dim=8, the model has head_dim=16"),
    ("qwen4_exp", dict(linear_conv_kernel_dim=3), "linear_conv_kernel_dim=3, the model has linear_conv_kernel_dim=4"),
    ("qwen4_exp", dict(layer_types=["linear_attention"] * 2 + ["indexed_attention"] * 2), "layer_types="),
    ("qwen4_exp", dict(ple_layer_ids=[3]), r"ple_layer_ids=\[3\], the model has ple_layer_ids=\[1\]"),
    ("inkling", dict(conv_kernel_size=3), "conv_kernel_size=3, the model has conv_kernel_size=4"),
    ("inkling", dict(sliding_window_size=9), "sliding_window_size=9, the model has sliding_window_size=6"),
    ("inkling", dict(swa_head_dim=16), "swa_head_dim=16, the model has swa_head_dim=8"),
    ("inkling", dict(num_key_value_heads=2), "num_key_value_heads=2, the model has num_key_value_heads=1"),
])
def test_cache_built_for_another_model_is_refused_before_the_step(qwen, ink, family, other, field):
    model = _model(family, qwen, ink)
    make = tiny_config if family == "qwen4_exp" else inkling.make_config
    cache = QSAPagedCache(make(**other), max_batch_size=3, max_cache_len=64)
    before = _host_state(cache)
    ids, mask = _batch(family)
    with pytest.raises(ValueError, match=f"the cache was built for {field}"):
        model(ids, attention_mask=mask, past_key_values=cache)
    assert _host_state(cache) == before and not cache.is_initialized


def test_cache_of_the_other_family_is_refused(qwen, ink):
    ids, mask = _batch("inkling")
    cache = QSAPagedCache(tiny_config(), max_batch_size=3, max_cache_len=64)
    with pytest.raises(ValueError, match="built for model_family='qwen4_exp', the model has model_family='inkling'"):
        ink[1](ids, attention_mask=mask, past_key_values=cache)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_cache_dtype_other_than_the_model_is_refused(qwen, ink, family):
    model = _model(family, qwen, ink)
    ids, mask = _batch(family)
    cache = QSAPagedCache(model.config, 3, 64, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"holds state in dtype=torch.bfloat16, the model runs in dtype=torch.float32"):
        model(ids, attention_mask=mask, past_key_values=cache)
    assert cache.columns_seen == 0
    # A cache that followed an fp32 model refuses a bf16 copy of it while it holds rows, naming reset();
    # once reset (empty), it follows the new dtype like a new cache.
    lazy = QSAPagedCache(model.config, 3, 64)
    model(ids, attention_mask=mask, past_key_values=lazy)
    half = type(model)(model.config).to(torch.bfloat16).eval()
    half.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match=r"ran in dtype=torch.float32, this one runs in dtype=torch.bfloat16: "
                                         r"call cache.reset\(\) first"):
        half(ids, attention_mask=mask, past_key_values=lazy)
    lazy.reset()
    with torch.no_grad():
        got = half(ids, attention_mask=mask, past_key_values=lazy).logits
        want = half(ids, attention_mask=mask, past_key_values=QSAPagedCache(model.config, 3, 64)).logits
    assert lazy.memory_stats()["total_bytes"] > 0 and all(s.dtype == torch.bfloat16 for layer in lazy.layers for s in layer.stores.values() if s.allocated)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_bad_input_gets_a_clear_error_before_any_change(qwen, ink, family):
    model = _model(family, qwen, ink)
    ids, mask = _batch(family)
    cache = QSAPagedCache(model.config, 3, 64)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    before = _host_state(cache)
    with pytest.raises(ValueError, match=r"at least one row and one token, got input of shape \[3, 0\]"):
        model(ids[:, :0], past_key_values=cache)
    vocab = model.config.vocab_size
    bad = ids[:, -2:].clone()
    bad[1, 0] = vocab
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {vocab}\) \(vocab_size\), got {vocab}"):
        model(bad, past_key_values=cache)
    assert _host_state(cache) == before
    # A fresh cache and no mask: the empty prompt is refused too (not a reshape error deep in the model).
    with pytest.raises(ValueError, match="at least one row and one token"):
        model(ids[:, :0])


# ----------------------------------------------------------------------------- a failing forward
class _Boom(RuntimeError):
    pass


def _fail_on_call(monkeypatch, module, call: int):
    """Make ``module.forward`` raise on its ``call``-th call (1-based) from now on."""
    original = module.forward
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise _Boom("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "forward", forward)
    return calls


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_failure_in_the_prefill_leaves_a_fresh_cache(qwen, ink, family, monkeypatch):
    model = _model(family, qwen, ink)
    ids, mask = _batch(family)
    expected = _generate(model, ids, mask, QSAPagedCache(model.config, 3, 64, block_size=4))

    cache = QSAPagedCache(model.config, 3, 64, block_size=4)
    fresh = _host_state(cache)
    layer = model.model.layers[-1]
    with monkeypatch.context() as m:
        _fail_on_call(m, layer, 1)
        with pytest.raises(_Boom):
            _generate(model, ids, mask, cache)
    assert _host_state(cache) == fresh
    tokens, logits = _generate(model, ids, mask, cache)
    assert tokens.tolist() == expected[0].tolist()
    torch.testing.assert_close(logits, expected[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_failure_in_a_chunk_of_a_long_prompt_leaves_a_fresh_cache(qwen, ink, family, monkeypatch):
    model = _model(family, qwen, ink)
    ids, mask = _batch(family)
    expected = _generate(model, ids, mask, QSAPagedCache(model.config, 3, 64, block_size=4))
    monkeypatch.setattr(model, "prefill_chunk_tokens", 3 * 4)  # chunks of 4 columns
    cache = QSAPagedCache(model.config, 3, 64, block_size=4)
    fresh = _host_state(cache)
    with monkeypatch.context() as m:
        calls = _fail_on_call(m, model.model.layers[0], 2)  # the second chunk
        with pytest.raises(_Boom):
            _generate(model, ids, mask, cache)
        assert len(calls) == 2
    assert _host_state(cache) == fresh
    tokens, logits = _generate(model, ids, mask, cache)
    assert tokens.tolist() == expected[0].tolist()
    torch.testing.assert_close(logits, expected[1], atol=1e-5, rtol=0)


def _prefill_and_decode(model, cache, ids, mask, steps):
    """Prefill then ``steps`` greedy decode steps by hand; returns (next tokens, mask) to continue from."""
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1]
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            logits = model(nxt, attention_mask=mask, past_key_values=cache).logits[:, -1]
    nxt = logits.argmax(-1, keepdim=True)
    return nxt, torch.cat([mask, torch.ones_like(nxt)], dim=1)


def _assert_failed_step_is_undone(model, make_cache, ids, mask, steps: int, failing, monkeypatch):
    """A decode step that raises inside ``failing`` leaves the cache exactly as before it: same host state,
    and the retried step gives the logits of a cache that never failed."""
    reference = make_cache()
    nxt, step_mask = _prefill_and_decode(model, reference, ids, mask, steps=steps)
    with torch.no_grad():
        expected = model(nxt, attention_mask=step_mask, past_key_values=reference).logits
    cache = make_cache()
    _prefill_and_decode(model, cache, ids, mask, steps=steps)
    before = _host_state(cache)
    with monkeypatch.context() as m:
        _fail_on_call(m, failing, 1)
        with pytest.raises(_Boom), torch.no_grad():
            model(nxt, attention_mask=step_mask, past_key_values=cache)
    assert _host_state(cache) == before
    with torch.no_grad():
        again = model(nxt, attention_mask=step_mask, past_key_values=cache).logits
    torch.testing.assert_close(again, expected, atol=1e-6, rtol=0)


def test_inkling_decode_failure_is_rolled_back_exactly(ink, monkeypatch):
    """Windows evict during these steps, so the roll-back must return freed blocks exactly."""
    _, model = ink
    ids, mask = _batch("inkling")
    _assert_failed_step_is_undone(model, lambda: QSAPagedCache(model.config, 3, 64, block_size=2), ids, mask,
                                  steps=5, failing=model.model.layers[3], monkeypatch=monkeypatch)


def test_qwen4_decode_failure_without_rollback_history_is_undone_exactly(qwen, monkeypatch):
    """Recurrent state and the QSA ring are overwritten in place: the step copies its rows aside first."""
    _, model = qwen
    ids, mask = _batch("qwen4_exp")
    _assert_failed_step_is_undone(model, lambda: QSAPagedCache(model.config, 3, 64, block_size=4), ids, mask,
                                  steps=2, failing=model.model.layers[-1], monkeypatch=monkeypatch)


@pytest.mark.parametrize("layer", [0, 1, 2])  # PLE + GatedDeltaNet, QSA, GatedDeltaNet
def test_qwen4_decode_failure_with_rollback_history_is_undone_exactly(qwen, monkeypatch, layer):
    """With num_speculative_tokens >= the step's length, the state before the step is still kept: the
    failed step is taken back exactly, wherever in the model it failed (here after the layer's attention
    or recurrence wrote its state)."""
    _, model = qwen
    ids, mask = _batch("qwen4_exp")
    _assert_failed_step_is_undone(
        model, lambda: QSAPagedCache(model.config, 3, 64, block_size=4, num_speculative_tokens=2), ids, mask,
        steps=3, failing=model.model.layers[layer].mlp, monkeypatch=monkeypatch,
    )


# ----------------------------------------------------------------------------- generate() requests
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_generate_refuses_what_cannot_fit_before_the_prefill(qwen, ink, family, monkeypatch):
    model = _model(family, qwen, ink)
    ids, mask = _batch(family)
    longest = int(mask.sum(1).max())
    cache = QSAPagedCache(model.config, 3, longest + NEW - 2, block_size=4)
    calls = _fail_on_call(monkeypatch, model.model, 0)  # counts forwards, never fails
    with pytest.raises(ValueError, match=rf"needs {longest + NEW - 1} slots \({longest} prompt tokens \+ "
                                         rf"max_new_tokens={NEW} - 1: the last new token is never fed back\), "
                                         rf"cache holds max_cache_len={longest + NEW - 2}"):
        _generate(model, ids, mask, cache)
    assert not calls and cache.columns_seen == 0
    # A pool too small for the request is refused up front as well.
    small = QSAPagedCache(model.config, 3, 64, block_size=4, num_blocks=6)
    with pytest.raises(ValueError, match="main block pool: this generate\\(\\) call needs"):
        _generate(model, ids, mask, small)
    assert not calls


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_generate_refuses_a_row_without_tokens(qwen, ink, family):
    model = _model(family, qwen, ink)
    ids, mask = _batch(family)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"row 1 of attention_mask has no real token"):
        _generate(model, ids, mask, None)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_generate_checks_an_unpadded_request_too(qwen, ink, family, monkeypatch):
    """generate() drops an all-ones mask before the cache is prepared; the request is still checked."""
    model = _model(family, qwen, ink)
    ids = _batch(family)[0][:1, -8:]
    cache = QSAPagedCache(model.config, 1, 8 + NEW - 2)
    calls = _fail_on_call(monkeypatch, model.model, 0)
    with pytest.raises(ValueError, match=rf"needs {8 + NEW - 1} slots \(8 prompt tokens"):
        _generate(model, ids, torch.ones_like(ids), cache)
    assert not calls


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_beam_search_on_a_padded_batch(qwen, ink, family):
    """The mask generate() leaves for the cache is already expanded for beams: rows fit the cache it builds."""
    model = _model(family, qwen, ink)
    ids, mask = _batch(family)
    kwargs = dict(max_new_tokens=4, num_beams=2, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **kwargs)
        for i in range(ids.shape[0]):
            row = ids[i][mask[i].bool()][None]
            alone = model.generate(row, attention_mask=torch.ones_like(row), **kwargs)
            assert out[i, -4:].tolist() == alone[0, -4:].tolist()


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_cache_implementation_in_the_generation_config_is_ignored(qwen, ink, family, monkeypatch):
    model = _model(family, qwen, ink)
    ids, mask = _batch(family)
    expected = _generate(model, ids, mask, QSAPagedCache(model.config, 3, 64))
    monkeypatch.setattr(model.generation_config, "cache_implementation", "static")
    _warned_cache_implementation.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        passed = _generate(model, ids, mask, QSAPagedCache(model.config, 3, 64))
        built = _generate(model, ids, mask, None)
        _generate(model, ids, mask, None, cache_implementation="dynamic")
    said = [w for w in caught if "cache_implementation" in str(w.message)]
    assert len(said) == 1 and "'static' is ignored" in str(said[0].message)
    for tokens, _ in (passed, built):
        assert tokens.tolist() == expected[0].tolist()


# ----------------------------------------------------------------------------- Qwen4Exp outputs
def test_qwen4_hidden_states_and_router_logits_match_upstream(qwen):
    ref, ours = qwen
    prompt = torch.tensor([random_prompts([21], seed=13)[0]])
    with torch.no_grad():
        want = ref(prompt, output_hidden_states=True, output_router_logits=True)
        got = ours(prompt, output_hidden_states=True, output_router_logits=True)
    assert len(got.hidden_states) == len(want.hidden_states) == ours.config.num_hidden_layers + 1
    for a, b in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert len(got.router_logits) == len(want.router_logits) == ours.config.num_hidden_layers
    for a, b in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, atol=1e-5, rtol=0)
    # generate() returns them per step as well.
    out = ours.generate(prompt, max_new_tokens=3, do_sample=False, output_hidden_states=True,
                        return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    assert len(out.hidden_states) == 3 and all(step[-1] is not None for step in out.hidden_states)
