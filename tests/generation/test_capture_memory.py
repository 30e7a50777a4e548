"""CUDA-graph capture failures are remembered per model, and MoE experts run a capturable implementation
in graph steps, checked on the CPU.

A runner with ``record=True`` goes through `DecodeGraphs._run_and_capture`; the two CUDA-only parts
are stood in for: the first eager run (`_warm_up`, on a side stream on CUDA) runs the same step here,
and the capture (`_capture`) either raises the error seen on the GPU for fp32 MoE models or returns a
graph whose replay runs the recorded step eagerly into the logits buffer.

* A failed capture is paid once per model and shape: every later cache (each generate() call builds
  one) runs that step eagerly at once, without trying again or warning again; another model, dtype
  or experts implementation tries again; a shape that captures keeps its graph when another fails.
* Under our default experts (``hf_qsa``) graph steps run ``batched_mm`` where our grouped path cannot be
  captured (fp32 or fp16 without the tiled kernels, or a GPU without torch's grouped-GEMM kernel), ours
  everywhere else; an implementation the user chose runs as chosen; each config's implementation is
  restored after the step (also when it fails).
"""

from __future__ import annotations

import warnings

import pytest
import helpers.inkling as inkling
import torch
from helpers.qwen4 import left_pad, make_pair, random_prompts
from transformers.integrations import moe

from hf_qsa_cache import fusions
from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache import cuda_graphs
from hf_qsa_cache.cuda_graphs import DecodeGraphs, capture_failures, experts_modules, graphs_of
from hf_qsa_cache.ops import prompt_experts
from hf_qsa_cache.ops.experts import OURS, graph_experts, grouped_mm_captures

CAPTURE_ERROR = ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor "
                 "is pinned")


def _ink_model():
    """Ours with our default experts (`make_pair` shares its config with the upstream twin, whose construction
    writes transformers' own default, ``grouped_mm``, into it)."""
    model = inkling.make_pair(inkling.make_config(), seed=9)[1]
    model.set_experts_implementation(OURS)
    return model


@pytest.fixture
def ink():
    """A fresh model per test: capture failures are remembered on the model."""
    ids, mask = inkling.left_pad(inkling.make_prompts([11, 4, 8], seed=10))
    return _ink_model(), ids, mask


class Replay:
    """A graph captured on the CPU: each replay runs the recorded step eagerly into the logits buffer."""

    def __init__(self, runner, entry):
        self.runner, self.entry = runner, entry

    def replay(self):
        self.entry.logits = self.runner._recorded(self.entry)


@pytest.fixture
def capture(monkeypatch):
    """Stand-ins for the CUDA-only parts of a capture; ``capture.fails(entry)`` decides which captures
    raise. Returns the log of attempts (each bucket's key)."""

    class Log(list):
        fails = staticmethod(lambda entry: True)

    log = Log()

    def fake_capture(runner, entry):
        log.append(entry.key)
        if log.fails(entry):
            raise RuntimeError(CAPTURE_ERROR)
        return Replay(runner, entry), None

    monkeypatch.setattr(DecodeGraphs, "_warm_up", lambda runner, entry: runner._eager(entry).clone())
    monkeypatch.setattr(DecodeGraphs, "_capture", fake_capture)
    return log


def _decode(model, ids, mask, steps, num_speculative_tokens=0, verify=()):
    """A fresh cache: prefill, then ``steps`` steps through a recording runner, a verify step of
    ``num_speculative_tokens + 1`` tokens (cropped back to one) at the indices in ``verify``; each step's
    logits checked against the ordinary forward on a second cache. Returns (runner, warnings)."""
    k = num_speculative_tokens
    cache = QSAPagedCache(model.config, 4, 96, block_size=4, num_speculative_tokens=k)
    eager = QSAPagedCache(model.config, 4, 96, block_size=4, num_speculative_tokens=k)
    runner = graphs_of(model, cache, "cpu")
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count every warning the code gives, not Python's first
        model(ids, attention_mask=mask, past_key_values=cache)
        logits = model(ids, attention_mask=mask, past_key_values=eager).logits[:, -1:]
        for step in range(steps):
            length = k + 1 if step in verify else 1
            nxt = torch.cat([logits[:, -1].argmax(-1, keepdim=True),
                             torch.randint(2, model.config.vocab_size, (ids.shape[0], length - 1), generator=gen)], 1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            logits = model(nxt, attention_mask=mask, past_key_values=eager).logits
            got = runner.step(nxt, None, mask)
            torch.testing.assert_close(got, logits, atol=5e-5, rtol=0, msg=lambda m: f"step {step}: {m}")
            if length > 1:
                for c in (cache, eager):
                    c.crop(-(length - 1))
                mask, logits = mask[:, : 1 - length], logits[:, :1]
    return runner, [w for w in caught if "CUDA graph capture failed" in str(w.message)]


def test_failed_capture_is_paid_once_per_model(ink, capture):
    model, ids, mask = ink
    runner, warned = _decode(model, ids, mask, 4)
    assert len(capture) == 1 and len(warned) == 1  # the bucket's first step tried, then ran eagerly
    assert CAPTURE_ERROR in str(warned[0].message) and "from now on" in str(warned[0].message)
    key = capture[0]
    assert key == ("cpu", torch.float32, "batched_mm", 4, 1, False) and CAPTURE_ERROR in capture_failures(model)[key]
    assert runner.buckets[4, 1, 96, False].eager and runner.buckets[4, 1, 96, False].graph is None
    # Each generate() builds a new cache, hence a new runner: it runs eagerly at once, quietly.
    for _ in range(2):
        runner, warned = _decode(model, ids, mask, 3)
        assert len(capture) == 1 and not warned and runner.buckets[4, 1, 96, False].eager
    # A new shape (a verify step) gets its try; failing the same way as the first, it fails quietly.
    runner, warned = _decode(model, ids, mask, 3, num_speculative_tokens=3, verify=(1,))
    assert capture[1:] == [("cpu", torch.float32, "batched_mm", 4, 4, False)] and not warned
    assert runner.buckets[4, 1, 96, False].eager and runner.buckets[4, 4, 96, False].eager
    # Another experts implementation is another path: it gets its own try (and its own warning).
    model.set_experts_implementation("eager")
    try:
        _, warned = _decode(model, ids, mask, 2)
        _, again = _decode(model, ids, mask, 2)
    finally:
        model.set_experts_implementation("grouped_mm")
    assert capture[2:] == [("cpu", torch.float32, "eager", 4, 1, False)] and len(warned) == 1 and not again
    # Another model has its own memory.
    other = _ink_model()
    _decode(other, ids, mask, 2)
    assert len(capture) == 4 and len(capture_failures(other)) == 1


def test_a_failing_shape_does_not_cost_shapes_that_capture(ink, capture):
    """Verify steps (4 tokens) fail to capture, decode steps capture: the decode graph is kept and replayed,
    the verify step runs eagerly, and the next cache captures decode again but never retries verify."""
    model, ids, mask = ink
    capture.fails = lambda entry: entry.ids.shape[1] > 1
    runner, warned = _decode(model, ids, mask, 6, num_speculative_tokens=3, verify=(1, 4))
    assert [key[3:5] for key in capture] == [(4, 1), (4, 4)] and len(warned) == 1
    assert runner.buckets[4, 1, 96, False].graph is not None and not runner.buckets[4, 1, 96, False].eager
    assert runner.buckets[4, 4, 96, False].eager and runner.buckets[4, 4, 96, False].graph is None
    runner, warned = _decode(model, ids, mask, 6, num_speculative_tokens=3, verify=(2, 3))
    assert [key[3:5] for key in capture] == [(4, 1), (4, 4), (4, 1)] and not warned
    assert runner.buckets[4, 1, 96, False].graph is not None and runner.buckets[4, 4, 96, False].eager
    assert list(capture_failures(model)) == [("cpu", torch.float32, "batched_mm", 4, 4, False)]


# ----------------------------------------------------------------------------- experts in graph steps
def test_grouped_mm_captures_only_where_torch_has_its_kernel(monkeypatch):
    cuda = torch.device("cuda", 0)
    for capability, bf16 in (((9, 0), True), ((10, 0), True), ((8, 0), False), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert grouped_mm_captures(torch.bfloat16, cuda) is bf16
        assert not grouped_mm_captures(torch.float32, cuda) and not grouped_mm_captures(torch.float16, cuda)
    assert not grouped_mm_captures(torch.bfloat16, torch.device("cpu"))


def test_graph_experts_choice(monkeypatch):
    from hf_qsa_cache.ops import experts as experts_ops

    monkeypatch.setitem(fusions.STATE, "experts", False)  # the choice without the fused experts
    monkeypatch.setitem(fusions.STATE, "tiled_experts", False)  # nor the tiled ones (on by default)
    _, model = make_pair(seed=7)
    model.set_experts_implementation(experts_ops.OURS)  # the default (make_pair's upstream twin set its own)
    experts = experts_modules(model)
    assert len(experts) == 4
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert graph_experts(model, experts, cuda, 1) == "batched_mm"  # fp32: our grouped GEMMs cannot be captured
    model.to(torch.bfloat16)
    assert graph_experts(model, experts, cuda, 1) is None  # bf16 on Hopper: ours captures
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert graph_experts(model, experts, cuda, 1) == "batched_mm"
    model.to(torch.float32)
    # A step gathering more expert weights than allowed keeps ours (and fails its capture once).
    gate_up = experts[0][0].gate_up_proj
    pair = gate_up[0].numel() * 4  # fp32 bytes of one expert's largest matrix, per token and routed expert
    top_k = model.config.num_experts_per_tok
    monkeypatch.setattr(experts_ops, "BATCHED_EXPERTS_MAX_BYTES", 8 * top_k * pair)
    assert graph_experts(model, experts, cuda, 8) == "batched_mm" and graph_experts(model, experts, cuda, 9) is None
    monkeypatch.undo()
    monkeypatch.setitem(fusions.STATE, "experts", False)
    # With the tiled experts, whose kernels capture in any dtype: ours up to their pairs' bound.
    monkeypatch.setitem(fusions.STATE, "tiled_experts", True)
    monkeypatch.setattr(experts_ops, "TILED_EXPERTS_MAX_PAIRS", 8 * top_k)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert graph_experts(model, experts, cuda, 8) is None and graph_experts(model, experts, cuda, 9) == "batched_mm"
    # An implementation the user chose runs as chosen, whatever the step.
    monkeypatch.setitem(fusions.STATE, "experts", True)
    for name in ("eager", "batched_mm", "grouped_mm", experts_ops.SELECTED_EXPERTS):
        model.set_experts_implementation(name)
        assert all(graph_experts(model, experts, cuda, t) is None for t in (1, 8, 9)), name
    assert graph_experts(torch.nn.Linear(2, 2), [], cuda, 1) is None  # no experts


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_graph_steps_run_batched_mm_and_restore_the_models_experts(family, monkeypatch):
    if family == "qwen4_exp":
        _, model = make_pair(seed=7)
        ids, mask = left_pad(random_prompts([25, 9, 19], seed=8))
    else:
        model = _ink_model()
        ids, mask = inkling.left_pad(inkling.make_prompts([11, 4, 8], seed=10))
    model.set_experts_implementation(OURS)  # the default (make_pair's upstream twin set its own)
    monkeypatch.setitem(fusions.STATE, "prompt_experts", False)  # ours then runs transformers' grouped_mm function
    calls = []
    for name in ("batched_mm", "grouped_mm"):
        run = moe.ALL_EXPERTS_FUNCTIONS[name]
        monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS, name,
                            lambda *a, run=run, name=name, **k: (calls.append(name), run(*a, **k))[1])
    cache = QSAPagedCache(model.config, 4, 64, block_size=4)
    runner = graphs_of(model, cache, "cpu", record=False)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
        assert not calls  # ours calls the function itself, not the registry's entry
        calls.clear()
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        runner.step(nxt, None, mask)
        assert set(calls) == {"batched_mm"} and runner.buckets[4, 1, 64, False].experts == "batched_mm"
        assert model.config._experts_implementation == OURS
        # A step that fails inside the layers still gives the model its own experts back.
        monkeypatch.setattr(model, "_decode_logits", lambda *a: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            runner.step(nxt, None, torch.cat([mask, torch.ones_like(nxt)], dim=1))
        assert model.config._experts_implementation == OURS


def test_graph_steps_follow_the_experts_the_user_chooses_later(monkeypatch):
    """A recorded step keeps the experts it ran; choosing others (`set_experts_implementation`) drops the
    recorded steps, and the chosen implementation runs as chosen."""
    _, model = make_pair(seed=7)
    model.set_experts_implementation(OURS)
    ids, mask = left_pad(random_prompts([25, 9, 19], seed=8))
    cache = QSAPagedCache(model.config, 4, 64, block_size=4)
    runner = graphs_of(model, cache, "cpu", record=False)
    calls = []
    for name in ("batched_mm", "eager"):
        run = moe.ALL_EXPERTS_FUNCTIONS.get(name)
        if run is not None:
            monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS, name,
                                lambda *a, run=run, name=name, **k: (calls.append(name), run(*a, **k))[1])
    with torch.no_grad():
        nxt = model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        for step, implementation in enumerate((OURS, "batched_mm", "eager")):
            model.set_experts_implementation(implementation)
            first = runner.buckets.get((4, 1, 64, False))
            calls.clear()
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            nxt = runner.step(nxt, None, mask)[:, -1].argmax(-1, keepdim=True)
            entry = runner.buckets[4, 1, 64, False]
            if implementation == OURS:  # ours on the CPU: transformers' batched_mm in graph steps
                assert entry.experts == "batched_mm" and calls == ["batched_mm"] * 4
            if implementation == "batched_mm":  # the user's choice: recorded anew, running it as chosen
                assert entry is not first and entry.experts is None and calls == ["batched_mm"] * 4
            if implementation == "eager":
                assert entry is not first and entry.experts is None and "batched_mm" not in calls
