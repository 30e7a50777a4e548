"""Programmatic dependent launch (the ``pdl`` setting, `hf_qsa_cache.ops.triton_common.pdl`): a kernel launched
early must wait (`pdl_begin`) before it touches memory, and a launch must pass the kernel's switch and Triton's
launch option together.

A kernel that reads before it waits would race the kernel before it: on the GPU a rare wrong answer, never an
error. So the rule is checked on the source of every kernel of the package, and on the launches of
`benchmarks/check_fused_kernels.py` run under the Triton interpreter with early launch emulated (the interpreter
cannot run the wait: it is counted per program instead). That each kernel also compiles with the wait for the GPU
is `kernel_compile`'s check (it compiles the ``PDL`` build of every kernel a test launches).
"""

from __future__ import annotations

import ast
import glob
import math
import os
import sys
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kernels_and_launches(path: str) -> tuple[dict[str, ast.FunctionDef], list[ast.Call]]:
    """The ``@triton.jit`` functions of a module that it launches (``kernel[grid](...)``), and those launches."""
    tree = ast.parse(open(path).read())
    jitted = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
              and any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list)}
    launches = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in jitted]
    return {call.func.value.id: jitted[call.func.value.id] for call in launches}, launches


def _triton_modules() -> list[str]:
    return sorted(glob.glob(os.path.join(REPO, "hf_qsa_cache", "ops", "*_triton.py")))


def test_every_kernel_waits_before_it_touches_memory():
    kernels = {}
    for path in _triton_modules():
        found, _ = _kernels_and_launches(path)
        kernels.update({f"{os.path.basename(path)}:{name}": fn for name, fn in found.items()})
    assert len(kernels) >= 30, sorted(kernels)
    for name, fn in kernels.items():
        switch = [a for a in fn.args.args if a.arg == "PDL"]
        assert switch and ast.unparse(switch[0].annotation) == "tl.constexpr", f"{name} takes no PDL switch"
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
            else fn.body
        assert ast.unparse(body[0]) == "pdl_begin(PDL)", f"{name} does not begin with pdl_begin(PDL)"


def test_every_launch_passes_the_switch_and_the_option_together():
    count = 0
    for path in _triton_modules():
        _, launches = _kernels_and_launches(path)
        for call in launches:
            spread = [k.value for k in call.keywords if k.arg is None]
            where = f"{os.path.basename(path)}:{call.lineno} {call.func.value.id}"
            assert any(isinstance(v, ast.Call) and ast.unparse(v.func) == "pdl" for v in spread), \
                f"{where} is launched without **pdl(...)"
            assert not {"PDL", "launch_pdl"} & {k.arg for k in call.keywords}, f"{where} sets PDL by hand"
            count += 1
    assert count >= 30


def test_the_switch_is_on_only_where_asked_and_supported(monkeypatch):
    from hf_qsa_cache.ops import triton_common

    gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(triton_common, "_pdl_supported", lambda device: device.type == "cuda")
    monkeypatch.setattr(triton_common, "INTERPRET", False)
    for setting, tensor, want in [(False, gpu, False), (True, gpu, True), (True, torch.zeros(1), False)]:
        monkeypatch.setattr(triton_common, "FUSED_PDL", setting)
        assert triton_common.pdl(tensor) == {"PDL": want, "launch_pdl": want}
    monkeypatch.setattr(triton_common, "INTERPRET", True)
    assert triton_common.pdl(gpu) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(triton_common, "INTERPRET", False)
    monkeypatch.setattr(triton_common, "_pdl_supported", lambda device: False)  # an older GPU or Triton
    assert triton_common.pdl(gpu) == {"PDL": False, "launch_pdl": False}
    # A CPU tensor never asks for it, whatever the setting.
    monkeypatch.undo()
    assert not triton_common._pdl_supported(torch.device("cpu"))


def test_the_setting_is_named_pdl_and_off_by_default():
    from hf_qsa_cache import fusions

    assert "pdl" in fusions.FLAGS and "pdl" in fusions.UNMEASURED
    assert "pdl" not in fusions.requested(None)
    from hf_qsa_cache.ops import triton_common

    with fusions.fused(("pdl",)):
        assert triton_common.FUSED_PDL
    assert triton_common.FUSED_PDL == fusions.fusion_enabled("pdl")


def test_kernels_wait_once_per_program_when_launched_early():
    from interpreter import run_under_interpreter

    run_under_interpreter(__file__, "early launch emulated ok", timeout=300)


def _emulate_early_launch():
    """Under the interpreter: the ``pdl`` setting on, its wait and trigger counted, each project launch recorded
    as (kernel, PDL, launch_pdl, programs). Only `pdl` is told the interpreter is off: the kernel modules, imported
    before, keep their own copy of the flag."""
    import triton.language.extra.cuda as cuda_extra
    from triton.runtime.interpreter import InterpretedFunction

    from hf_qsa_cache.ops import triton_common

    counts = {"wait": 0, "trigger": 0}
    cuda_extra.gdc_wait = lambda *a, **k: counts.__setitem__("wait", counts["wait"] + 1)
    cuda_extra.gdc_launch_dependents = lambda *a, **k: counts.__setitem__("trigger", counts["trigger"] + 1)
    triton_common.INTERPRET, triton_common.FUSED_PDL = False, True
    triton_common._pdl_supported = lambda device: True
    launches = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith("hf_qsa_cache"):
            launches.append((self.fn.__name__, kwargs.get("PDL"), kwargs.get("launch_pdl"), math.prod(grid)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    return counts, launches


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import check_fused_kernels  # first: the kernel modules copy the interpreter flag at import (bf16 dots widen)

    counts, launches = _emulate_early_launch()

    rows = check_fused_kernels.main(["--device", "cpu", "--small", "--repeat", "1", "--tokens", "3"])
    assert rows and all(r["ok"] for r in rows), rows
    late = sorted({name for name, switch, option, _ in launches if not (switch and option)})
    assert not late, f"launched without the switch or the option: {late}"
    programs = sum(p for *_, p in launches)
    assert counts["wait"] == counts["trigger"] == programs, (counts, programs)
    kernels = {name for name, *_ in launches}
    assert len(kernels) >= 15, sorted(kernels)
    print(f"early launch emulated ok: {len(launches)} launches of {len(kernels)} kernels, {programs} programs")
