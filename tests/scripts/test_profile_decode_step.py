"""benchmarks/profile_decode_step.py attributes a decode step's time to layer kinds (CPU, tiny models).

On the CPU the script reports CPU time (its GPU columns need CUDA); this checks its bookkeeping: every
layer kind of the model and each layer's children get a range, children fit inside their layer, the
layers inside the step.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("model", ["qwen4_exp", "inkling"])
def test_every_layer_kind_and_child_is_timed_inside_the_step(model):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import profile_decode_step as script
    finally:
        sys.path.pop(0)
    result = script.main(["--model", model, "--device", "cpu", "--tiny", "--prompt", "21", "--steps", "1"])
    kinds = result["kinds"]
    from bench_speculative import build

    built, _ = build(model, None, "cpu", True)
    layer_types = set(built.config.layer_types)
    assert {k.split(" ", 1)[1] for k in kinds if k.startswith("layer ")} == layer_types
    for kind in layer_types:
        layer = kinds[f"layer {kind}"]["us"]
        children = [v["us"] for k, v in kinds.items() if k.startswith(kind + ".") and k.count(".") == 1]
        assert children and 0 < sum(children) <= layer
        assert f"{kind}.mlp" in kinds
    assert sum(v["us"] for k, v in kinds.items() if k.startswith("layer ")) <= kinds["step"]["us"]


def test_the_ranges_leave_the_fusions_on():
    # A module with hooks of its own keeps its own forward (no fusion): the profile's ranges must not be such
    # hooks, or a profile with HF_QSA_FUSED set would time the unfused step.
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import profile_decode_step as script
        from bench_speculative import build
    finally:
        sys.path.pop(0)
    from hf_qsa_cache.ops import keeps_own_forward

    model, _ = build("qwen4_exp", None, "cpu", True)
    handles = script.label_modules(model)
    try:
        layer = model.model.layers[0]
        for module in (layer, *layer.children(), *layer.mlp.children()):
            assert not keeps_own_forward(module)
    finally:
        for handle in handles:
            handle.remove()


def test_gpu_kernels_count_for_the_ranges_they_ran_in():
    """On a GPU a kernel counts for every labelled range whose time holds it (the profiler links Triton's
    launches to no range): nested ranges both count it, a kernel after a range counts only for the step,
    and the device total sees every kernel (and no drain's wait). Synthetic profiler events, microseconds."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import profile_decode_step as script
    finally:
        sys.path.pop(0)

    def cpu(label, start, end):
        return SimpleNamespace(name=script.PREFIX + label, device_type=DeviceType.CPU,
                               time_range=Interval(start, end), cpu_children=[])

    def kernel(start, end):
        return SimpleNamespace(name="_some_triton_kernel", device_type=DeviceType.CUDA, time_range=Interval(start, end))

    # A drain's wait, recorded on the device timeline too, is no kernel: it counts nowhere.
    wait = SimpleNamespace(name="Device Synchronize", device_type=DeviceType.CUDA, time_range=Interval(41, 49))
    events = [cpu("step", 0, 100), cpu("layer a", 10, 50), cpu("a.mlp", 12, 30), kernel(13, 20), kernel(31, 40),
              wait, kernel(60, 70), kernel(120, 125)]
    kinds = script.by_kind(SimpleNamespace(events=lambda: events), steps=1, on_gpu=True)
    assert kinds["a.mlp"]["kernels"] == 1 and kinds["a.mlp"]["us"] == 7
    assert kinds["layer a"]["kernels"] == 2 and kinds["layer a"]["us"] == 16
    assert kinds["step"]["kernels"] == 3 and kinds["step"]["us"] == 26
    assert kinds["device total"]["kernels"] == 4
