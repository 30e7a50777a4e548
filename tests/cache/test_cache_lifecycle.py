"""What a cache does between and around steps (CPU, fp32, both families):

* a new generate() call on a cache that holds rows must continue them, or is refused naming reset();
* the inherited `Cache` batch methods (repeat, select) work and keep pools exact;
* graph runners hold their model and cache weakly (a deleted model or dropped cache is freed at once), pause
  the garbage collector while capturing, and forget graphs when weights move;
* the recorded step reads a whole sequence's position_ids as the eager forward does;
* a crop deeper than the windows kept is refused, and a crop within them gives the right next logits.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers.faults import host_state
from helpers.qwen4 import make_pair
from helpers.batches import family_prompts as _prompts
from helpers.graphs import ReplayingGraphs

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.cuda_graphs import graphs_of

NEW = 4


def _setup(family, qwen, ink):
    return (qwen if family == "qwen4_exp" else ink), *_prompts(family)


def _generate(model, ids, mask, cache, new=NEW):
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)


# ----------------------------------------------------------------------------- reuse without reset()
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_a_new_prompt_on_a_used_cache_is_refused_naming_reset(qwen, ink, family):
    model, ids, mask = _setup(family, qwen, ink)
    cache = QSAPagedCache(model.config, 3, 96, block_size=4)
    first = _generate(model, ids, mask, cache)
    before = host_state(cache)
    other = torch.randint(2, model.config.vocab_size, first.shape, generator=torch.Generator().manual_seed(1))
    wider = torch.cat([other, other[:, :5]], dim=1)
    for new_ids, message in [(other, "row 0 of input_ids does not start with the tokens the cache holds"),
                             (wider, "row 0 of input_ids does not start with the tokens the cache holds"),
                             (other[:, :10], "holds .* columns of an earlier call and input_ids has 10"),
                             (first[:, :-1], "does not continue them"),
                             (first[:2], "holds 3 rows of an earlier call, this call has 2")]:
        with pytest.raises(ValueError, match=message + r".*call cache.reset\(\)"):
            _generate(model, new_ids, torch.ones_like(new_ids), cache)
        assert host_state(cache) == before
    # Continuing the sequences the cache holds is what it is for: equal to generating it all at once.
    more = _generate(model, first, torch.cat([mask, torch.ones_like(first[:, mask.shape[1]:])], 1), cache)
    whole = _generate(model, ids, mask, QSAPagedCache(model.config, 3, 96, block_size=4), new=2 * NEW)
    assert more.tolist() == whole.tolist()
    # One changed token of one row, inside what the cache holds, is noticed too.
    tampered = more.clone()
    tampered[2, -3] = (tampered[2, -3] + 1) % model.config.vocab_size
    with pytest.raises(ValueError, match="row 2 of input_ids does not start with the tokens"):
        _generate(model, torch.cat([tampered, tampered[:, -1:]], 1), None, cache)


# ----------------------------------------------------------------------------- inherited Cache methods
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_batch_repeat_and_select_match_fresh_caches(qwen, ink, family):
    model, ids, mask = _setup(family, qwen, ink)
    cache = QSAPagedCache(model.config, 6, 64, block_size=4)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        cache.batch_repeat_interleave(2)  # rows 0 0 1 1 2 2
        assert cache.num_rows == 6 and cache.lengths == [int(n) for n in mask.sum(1).repeat_interleave(2)]
        nxt = torch.randint(2, model.config.vocab_size, (6, 1), generator=torch.Generator().manual_seed(2))
        step_mask = torch.cat([mask.repeat_interleave(2, 0), torch.ones_like(nxt)], 1)
        got = model(nxt, attention_mask=step_mask, past_key_values=cache).logits
        fresh = QSAPagedCache(model.config, 6, 64, block_size=4)
        model(ids.repeat_interleave(2, 0), attention_mask=mask.repeat_interleave(2, 0), past_key_values=fresh)
        want = model(nxt, attention_mask=step_mask, past_key_values=fresh).logits
        torch.testing.assert_close(got, want, atol=5e-5, rtol=0)

        keep = torch.tensor([5, 0])  # reorders and drops: rows 1..4 give their blocks back
        cache.batch_select_indices(keep)
        assert cache.num_rows == 2
        nxt2 = nxt[keep] + 1
        mask2 = torch.cat([step_mask[keep], torch.ones_like(nxt2)], 1)
        got = model(nxt2, attention_mask=mask2, past_key_values=cache).logits
        fresh = QSAPagedCache(model.config, 6, 64, block_size=4)
        model(ids.repeat_interleave(2, 0)[keep], attention_mask=mask.repeat_interleave(2, 0)[keep],
              past_key_values=fresh)
        model(nxt[keep], attention_mask=step_mask[keep], past_key_values=fresh)
        want = model(nxt2, attention_mask=mask2, past_key_values=fresh).logits
        torch.testing.assert_close(got, want, atol=5e-5, rtol=0)
        for name, table in cache.tables.items():
            assert table.blocks_in_use() == fresh.tables[name].blocks_in_use(), name
    with pytest.raises(ValueError, match=r"row indices must lie in \[0, 2\)"):
        cache.batch_select_indices(torch.tensor([2]))
    with pytest.raises(ValueError, match="1 to max_batch_size=6 rows, asked for 8"):
        cache.batch_repeat_interleave(4)


@pytest.mark.parametrize("method", ["update_conv_state", "update_recurrent_state", "update_indexer",
                                    "early_initialization", "offload", "prefetch"])
def test_inherited_methods_that_do_not_apply_say_why(qwen, method):
    cache = QSAPagedCache(qwen.config, 2, 32)
    with pytest.raises(NotImplementedError, match="QSAPagedCache"):
        getattr(cache, method)(*([None] * 2))


def test_inherited_properties_describe_the_layers(qwen):
    cache = QSAPagedCache(qwen.config, 2, 32)
    assert cache.is_linear == [t == "linear_attention" for t in qwen.config.layer_types]
    assert not any(cache.is_dummy) and not cache.has_previous_state()


# ----------------------------------------------------------------------------- graph runners
def test_graph_runners_do_not_keep_models_alive(qwen):
    cache = QSAPagedCache(qwen.config, 2, 32)
    refs = []
    for seed in range(3):
        model = make_pair(seed=seed)[1]
        graphs_of(model, cache, "cpu", record=False)
        refs.append(weakref.ref(model))
        del model
    gc.collect()
    assert all(r() is None for r in refs) and len(cache.graph_runners) == 0


def test_a_dropped_cache_frees_its_graphs_without_the_collector(qwen):
    """A runner holds its cache weakly: dropping the cache frees its graphs at once, not at a later run of
    Python's collector (which may come in the middle of another capture: destroying a graph then invalidates
    that capture)."""
    model = make_pair(seed=0)[1]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        cache = QSAPagedCache(qwen.config, 2, 32)
        runner = graphs_of(model, cache, "cpu", record=False)
        assert runner.cache is cache
        refs = weakref.ref(cache), weakref.ref(runner)
        del cache, runner
        assert all(r() is None for r in refs)
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("enabled", [True, False])
def test_captures_run_with_the_collector_paused(enabled):
    """`collector_paused` (around every capture) keeps the collector off inside and puts it back as it was,
    also when the capture raises."""
    from hf_qsa_cache.cuda_graphs import collector_paused

    was_enabled = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(RuntimeError, match="capture failed"):
            with collector_paused():
                assert not gc.isenabled()
                raise RuntimeError("capture failed")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was_enabled else gc.disable)()


def test_graphs_are_forgotten_when_weights_move_or_hooks_change(qwen):
    model, ids, mask = _setup("qwen4_exp", qwen, None)
    cache = QSAPagedCache(model.config, 4, 64, block_size=4)
    runner = cache.graph_runners[model] = ReplayingGraphs(model, cache, "cpu", record=True)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1:]

        def step():
            nonlocal mask, logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            logits = runner.step(nxt, None, mask)

        step()
        step()
        assert runner.buckets[4, 1, 64, False].graph.replays == 1
        weight = model.lm_head.weight  # moved (as model.cpu(); model.cuda() may do): new storage
        weight.data = weight.data.clone()
        step()
        assert runner.buckets[4, 1, 64, False].graph is not None and runner.buckets[4, 1, 64, False].graph.replays == 0
        step()
        handle = model.model.layers[1].register_forward_hook(lambda *a: None)
        try:
            step()  # the first graphed step after the hook: a fresh capture, not a replay
            assert runner.buckets[4, 1, 64, False].graph.replays == 0
        finally:
            handle.remove()


@pytest.mark.parametrize("record", [False, True])
def test_recorded_step_reads_whole_sequence_position_ids(qwen, record):
    """A caller may pass the positions of every column so far; the step takes its last ones, as the eager
    forward does, on the eager static-buffer path and on replays (buffers refreshed every step)."""
    model, ids, mask = _setup("qwen4_exp", qwen, None)
    eager = QSAPagedCache(model.config, 4, 64, block_size=4)
    static = QSAPagedCache(model.config, 4, 64, block_size=4)
    runner = static.graph_runners[model] = ReplayingGraphs(model, static, "cpu", record=record)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=eager, position_ids=positions).logits[:, -1:]
        model(ids, attention_mask=mask, past_key_values=static, position_ids=positions)
        for step in range(4):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
            logits = model(nxt, attention_mask=mask, past_key_values=eager, position_ids=positions).logits
            got = runner.step(nxt, positions, mask)
            torch.testing.assert_close(got, logits, atol=5e-5, rtol=0, msg=lambda m: f"step {step}: {m}")
    if record:
        assert runner.buckets[4, 1, 64, False].graph.replays == 3


def test_replay_reads_the_tables_it_was_recorded_with(ink):
    """A device table that moved (a new tensor) must not be replayed against: the runner re-records."""
    model, ids, mask = _setup("inkling", None, ink)
    cache = QSAPagedCache(model.config, 4, 64, block_size=4)
    eager = QSAPagedCache(model.config, 4, 64, block_size=4)
    runner = cache.graph_runners[model] = ReplayingGraphs(model, cache, "cpu", record=True)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=eager).logits[:, -1:]
        model(ids, attention_mask=mask, past_key_values=cache)
        for step in range(6):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            if step == 3:
                for table in cache.tables.values():  # as a move to another device does
                    table._device = table._device.clone()
            logits = model(nxt, attention_mask=mask, past_key_values=eager).logits
            torch.testing.assert_close(runner.step(nxt, None, mask), logits, atol=5e-5, rtol=0)


# ----------------------------------------------------------------------------- Inkling crop reach
def test_inkling_crop_deeper_than_the_windows_kept_is_refused(ink):
    """With k = 2 the windows keep 2 positions more than the next query reads: crops of 1-2 tokens work
    (next logits equal a cache that never held the dropped tokens), 3 and 4 are refused unchanged."""
    model, ids, mask = _setup("inkling", None, ink)
    k = 2
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for drop in (1, 2, 3, 4):
            cache = QSAPagedCache(model.config, 3, 96, block_size=2, num_speculative_tokens=k)
            model(ids, attention_mask=mask, past_key_values=cache)
            extra = torch.randint(2, model.config.vocab_size, (3, 12), generator=gen)
            steps = torch.cat([ids, extra], 1)
            full_mask = torch.cat([mask, torch.ones_like(extra)], 1)
            for j in range(extra.shape[1]):  # decode so windows evict
                model(extra[:, j:j + 1], attention_mask=full_mask[:, : mask.shape[1] + j + 1], past_key_values=cache)
            if drop > k:
                before = host_state(cache)
                with pytest.raises(ValueError, match="already freed"):
                    cache.crop(-drop)
                assert host_state(cache) == before
                continue
            cache.crop(-drop)
            keep = steps.shape[1] - drop
            nxt = torch.full((3, 1), 5)
            got = model(nxt, attention_mask=torch.cat([full_mask[:, :keep], torch.ones_like(nxt)], 1),
                        past_key_values=cache).logits
            fresh = QSAPagedCache(model.config, 3, 96, block_size=2)
            want = model(torch.cat([steps[:, :keep], nxt], 1),
                         attention_mask=torch.cat([full_mask[:, :keep], torch.ones_like(nxt)], 1),
                         past_key_values=fresh).logits[:, -1:]
            torch.testing.assert_close(got, want, atol=5e-5, rtol=0)


def test_graphed_decode_steps_walk_the_model_once(qwen, monkeypatch):
    """The full weight and hook walk (about a millisecond at the released depths) runs on the first graphed
    step after a step the runner did not take, not on every decode step of generate()."""
    import hf_qsa_cache.cuda_graphs as cuda_graphs

    model, ids, mask = _setup("qwen4_exp", qwen, None)
    cache = QSAPagedCache(model.config, 4, 64, block_size=4)
    runner = cache.graph_runners[model] = ReplayingGraphs(model, cache, "cpu", record=True)
    walks = []
    real = cuda_graphs.model_fingerprint
    monkeypatch.setattr(cuda_graphs, "model_fingerprint", lambda m: walks.append(1) or real(m))
    import modeling.modeling_qwen4_exp as qwen_module

    monkeypatch.setattr(qwen_module, "decode_graphs_for", lambda model, cache, ids, *a, **k:  # as on a GPU
                        runner if cache is not None and cache.columns_seen and ids.shape[1] == 1 else None)
    _generate(model, ids, mask, cache, new=6)
    assert len(walks) == 1 and runner.buckets[4, 1, 64, False].graph.replays == 4
