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
from functools import partial
from pathlib import Path

import pytest
import torch

from hf_qsa_cache import fusions

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kernels_and_launches(path: str) -> tuple[dict[str, ast.FunctionDef], list[ast.Call]]:
    """The ``@triton.jit`` functions of a module that it launches (``kernel[grid](...)``), and those launches."""
    tree = ast.parse(Path(path).read_text())
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
        body = _statements(fn)
        assert "pdl_begin(PDL)" in body, f"{name} never calls pdl_begin(PDL)"
        before = body[:body.index("pdl_begin(PDL)")]
        # Before the wait: index arithmetic, prefetches of weights (hints: they read nothing into the kernel) and
        # the named early reads (what only earlier launches write).
        assert not _memory_access(before), f"{name} touches memory before pdl_begin(PDL): {before}"
        assert _calls(before) <= _INDEX_OPS | _PREFETCHES | set(_EARLY_READS), \
            f"{name} calls {_calls(before)} before pdl_begin(PDL)"


def _statements(fn: ast.FunctionDef) -> list[str]:
    """The body's statements as source, its docstring left out."""
    return [ast.unparse(s) for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]


_INDEX_OPS = {"tl.program_id", "tl.cdiv", "tl.arange", "tl.static_range", "tl.minimum", ".to",
              "tl.multiple_of",  # (an alignment hint to the compiler: no access)
              "tl.zeros"}  # (registers only)
_PREFETCHES = {"prefetch_rows_l2", "prefetch_l2"}
# The helpers a kernel may call before its wait, which read only what the launch just before it cannot write
# (`triton_common.pdl_begin`): weights, the step's metadata, and what earlier steps stored. By module.
_EARLY_READS = {"_conv_history": "conv_norm_triton.py", "norm_weight": "triton_common.py",
                "_gemv_weights": "linears_triton.py",
                "_key_ranges": "inkling_attention_triton.py", "_router_weights": "router_triton.py",
                "_store_keys_to_l2": "inkling_attention_triton.py", "_store_slots": "inkling_attention_triton.py"}


def _calls(statements: list[str]) -> set[str]:
    """The functions called: ``name``, ``tl.name``, or ``.method`` for a method of a value."""
    names = set()
    for node in (n for s in statements for n in ast.walk(ast.parse(s)) if isinstance(n, ast.Call)):
        func = node.func
        names.add(func.id if isinstance(func, ast.Name) else f"tl.{func.attr}"
                  if isinstance(func.value, ast.Name) and func.value.id == "tl" else f".{func.attr}")
    return names


def _memory_access(statements: list[str]) -> bool:
    return any(op in s for s in statements for op in ("tl.load", "tl.store", "tl.atomic"))


def test_the_prefetches_only_ask_for_lines():
    """What a kernel may call before its wait reads nothing: the prefetch helpers hold no load, store or atomic,
    and call only each other and index arithmetic (the inline instruction is ``prefetch.global.L2``)."""
    sources = {}
    for path in [*_triton_modules(), os.path.join(REPO, "hf_qsa_cache", "ops", "triton_common.py")]:
        tree = ast.parse(Path(path).read_text())
        sources.update({n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in _PREFETCHES})
    assert set(sources) == _PREFETCHES
    for name, fn in sources.items():
        body = _statements(fn)
        assert not _memory_access(body), name
        assert _calls(body) <= _INDEX_OPS | _PREFETCHES | {"tl.inline_asm_elementwise"}, (name, _calls(body))
        asm = [s for s in body if "inline_asm" in s]
        assert all("prefetch.global.L2" in s and "ld." not in s and "st." not in s for s in asm), asm


def test_the_early_reads_only_read():
    """The helpers called before the wait write nothing, wait for nothing, and read only through their pointer
    arguments, which the kernels that call them pass weights, metadata and stores (never this step's inputs)."""
    for name, module in _EARLY_READS.items():
        tree = ast.parse(Path(REPO, "hf_qsa_cache", "ops", module).read_text())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        body = _statements(fn)
        assert not any(op in s for s in body for op in ("tl.store", "tl.atomic", "pdl_begin", "inline_asm")), name
        allowed = _INDEX_OPS | _PREFETCHES | set(_EARLY_READS) | {"tl.load", "tl.zeros", "tl.where", "tl.maximum",
                                                                   "tl.max", "tl.min", "range"}
        assert _calls(body) <= allowed, (name, _calls(body))
    # The pointers they are given, at each call: none is a kernel's input from the launch before (its x, q, k, v).
    called = set()
    for path in _triton_modules():
        tree = ast.parse(Path(path).read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id in _EARLY_READS]
        called |= {call.func.id for call in calls}
        for call in calls:
            names = {a.id for a in call.args if isinstance(a, ast.Name) and a.id.endswith("_ptr")}
            assert not names & {"x_ptr", "q_ptr", "k_ptr", "v_ptr", "residual_ptr"}, (path, ast.unparse(call))
    assert called == set(_EARLY_READS)


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
        monkeypatch.setitem(fusions.STATE, "pdl", setting)
        assert triton_common.pdl(tensor) == {"PDL": want, "launch_pdl": want}
    monkeypatch.setattr(triton_common, "INTERPRET", True)
    assert triton_common.pdl(gpu) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(triton_common, "INTERPRET", False)
    monkeypatch.setattr(triton_common, "_pdl_supported", lambda device: False)  # an older GPU or Triton
    assert triton_common.pdl(gpu) == {"PDL": False, "launch_pdl": False}
    # A CPU tensor never asks for it, whatever the setting.
    monkeypatch.undo()
    assert not triton_common._pdl_supported(torch.device("cpu"))


def test_the_setting_is_named_pdl_and_on_by_default():
    from hf_qsa_cache import fusions

    assert fusions.FUSIONS["pdl"]
    assert "pdl" in fusions.requested(None)
    from hf_qsa_cache.ops import triton_common

    with fusions.fused(("pdl",)):
        assert fusions.enabled("pdl")


def _emulate_early_launch():
    """Under the interpreter: the ``pdl`` setting on, its wait and trigger counted, each project launch recorded
    as (kernel, PDL, launch_pdl, programs). Only `pdl` is told the interpreter is off: the kernel modules, imported
    before, keep their own copy of the flag."""
    import triton.language.extra.cuda as cuda_extra
    from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder

    from hf_qsa_cache.ops import triton_common

    counts = {"wait": 0, "trigger": 0}
    prefetched = []
    cuda_extra.gdc_wait = lambda *a, **k: counts.__setitem__("wait", counts["wait"] + 1)
    cuda_extra.gdc_launch_dependents = lambda *a, **k: counts.__setitem__("trigger", counts["trigger"] + 1)
    triton_common.INTERPRET, fusions.STATE["pdl"] = False, True
    triton_common._pdl_supported = lambda device: True
    launches = []
    InterpreterBuilder.create_inline_asm = _record_prefetch(prefetched, launches)
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith("hf_qsa_cache"):
            launches.append((self.fn.__name__, kwargs.get("PDL"), kwargs.get("launch_pdl"), math.prod(grid)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    return counts, launches, prefetched


def _record_prefetch(prefetched: list, launches: list):
    """The interpreter's inline assembly, for `prefetch_l2` only: (the kernel launched last, the addresses it asks
    for where its mask is on) appended to ``prefetched``, one per call."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def create_inline_asm(builder, asm, constraints, values, result_types, is_pure, pack):
        assert "prefetch.global.L2" in asm and not is_pure, asm
        ptrs, mask = values
        prefetched.append((launches[-1][0], ptrs.data[mask.data != 0].ravel().tolist()))
        result = TensorHandle(np.zeros(ptrs.data.shape, np.int32), tl.int32)
        return types.SimpleNamespace(get_result=lambda i: result)

    return create_inline_asm


def _check_projection_prefetch(prefetched: list) -> None:
    """Launched early, the projections kernel asks for exactly its weights' 128-byte lines, each once (rows of
    fp32 and bf16 that end inside a line, weights of row counts its tiles do not divide)."""
    from hf_qsa_cache.ops import linears_triton

    for dtype, K in [(torch.float32, 200), (torch.bfloat16, 72)]:
        x = torch.randn(3, K).to(dtype)
        weights = [torch.randn(n, K).to(dtype) for n in (40, 17, 3)]
        del prefetched[:]
        out = linears_triton.linears_triton(x, weights, tiles=(16, 32, 4))
        for o, w in zip(out, weights):
            torch.testing.assert_close(o.float(), x.float() @ w.float().T, atol=0.05, rtol=0.02)
        want = [line for w in weights for line in _lines(w)]
        assert _asked(prefetched, "_linears_kernel") == sorted(want), dtype


def _lines(matrix: torch.Tensor) -> list[int]:
    """The address of each 128-byte step along each row of ``matrix`` (rows of contiguous elements)."""
    rows = matrix.reshape(-1, matrix.shape[-1])
    row_bytes = rows.shape[1] * rows.element_size()
    return [rows.data_ptr() + r * rows.stride(0) * rows.element_size() + j for r in range(rows.shape[0])
            for j in range(0, row_bytes, 128)]


def _asked(prefetched: list, kernel: str) -> list[int]:
    return sorted(a for name, addresses in prefetched if name == kernel for a in addresses)


def _check_router_prefetch(prefetched: list) -> None:
    """Launched early, the router's projection asks for its weight only, all of it, whatever the split of the
    hidden size: every line asked for starts inside the weight, and together they cover every byte of it. Where
    each range is one chunk (the policy's split of a 64-wide hidden size) it reads the rows instead: no request."""
    from hf_qsa_cache.ops import router_triton

    for dtype, H, block_h, splits in [(torch.float32, 100, 16, 3), (torch.bfloat16, 72, 16, 2),
                                      (torch.float32, 64, 256, None)]:
        x, weight = torch.randn(2, H).to(dtype), torch.randn(21, H).to(dtype)
        del prefetched[:]
        part = router_triton.router_partials(x, weight, block_h, splits)
        torch.testing.assert_close(part.sum(0), x.float() @ weight.float().T, atol=1e-3, rtol=1e-3)
        if H == 64:
            assert not _asked(prefetched, "_router_logits_kernel"), "one-chunk ranges read their rows early"
        else:
            _assert_covers(_asked(prefetched, "_router_logits_kernel"), [weight], dtype)


def _assert_covers(asked: list[int], tensors: list[torch.Tensor], where) -> None:
    """Every line asked for starts inside one of ``tensors`` (contiguous), and the 128 bytes from each cover every
    byte of them."""
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    covered = [set() for _ in spans]
    for a in asked:
        inside = [i for i, (start, size) in enumerate(spans) if start <= a < start + size]
        assert inside, (where, "a line outside the weights")
        start, size = spans[inside[0]]
        covered[inside[0]].update(range(a - start, min(a - start + 128, size)))
    assert all(c == set(range(size)) for c, (_, size) in zip(covered, spans)), (where, "bytes not asked for")


def _check_mixing_prefetch(prefetched: list) -> None:
    """Launched early, the hyper-connection mixing's two kernels ask for their weights only, all of them: the
    down and injection projections (split over the input, a split ending inside a line; in the dot form for two
    tokens and the GEMV form for one) and the up projection."""
    from hf_qsa_cache.ops import hyper_connection, hyper_connection_triton

    dot = hyper_connection_triton.MixTiles(splits=3, block_n=16, block_k=16, down_warps=1, block_h=16, r_chunk=16,
                                           up_warps=1)
    gemv = hyper_connection_triton.MixTiles(splits=3, block_n=4, block_k=8, down_warps=1, block_h=16, r_chunk=16,
                                            up_warps=1, gemv=True)
    hc, H, R = 4, 24, 20
    for dtype, tokens, tiles in ((torch.float32, 2, dot), (torch.bfloat16, 2, dot), (torch.bfloat16, 1, gemv)):
        normed, down = torch.randn(tokens, hc * H).to(dtype), (torch.randn(R, hc * H) * 0.1).to(dtype)
        up, inject = (torch.randn(hc * H, R) * 0.1).to(dtype), (torch.randn(hc, hc * H) * 0.1).to(dtype)
        del prefetched[:]
        got = hyper_connection_triton.mix_projections_triton(normed, down, up, inject, hc, tiles)
        want = hyper_connection.mix_projections(normed, down, up, inject, hc)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), atol=0.02, rtol=0.02)
        _assert_covers(_asked(prefetched, "_hc_down_kernel"), [down, inject], dtype)
        _assert_covers(_asked(prefetched, "_hc_up_mix_kernel"), [up], dtype)


def _check_shared_expert_prefetch(prefetched: list) -> None:
    """Launched early, the experts' kernels ask for the shared experts' lines only (a routed expert is the router's
    choice): the gate-up kernel each shared pair's gate and up rows, the down kernel each token's shared down rows,
    every line once per token; with rows in fp32 and bf16 and two shared experts."""
    from hf_qsa_cache.ops import experts, experts_triton

    g = torch.Generator().manual_seed(3)
    T, H, I, E, k, S, Is = 2, 40, 24, 5, 2, 2, 36
    for dtype in (torch.float32, torch.bfloat16):
        def rand(*shape):
            return (torch.randn(*shape, generator=g) * 0.2).to(dtype)

        x, gate_up, down = rand(T, H), rand(E, 2 * I, H), rand(E, H, I)
        ids = torch.tensor([[0, 3], [4, 1]])
        weights = torch.rand(T, k, generator=g)
        shared = experts.SharedExpert(rand(S, Is, H), rand(S, Is, H), rand(S, H, Is),
                                      token_weights=torch.rand(T, S, generator=g))
        del prefetched[:]
        got = experts_triton.selected_experts_triton(x, ids, weights, gate_up, down, False, shared)
        want = experts.selected_experts_torch(x, ids, weights, gate_up, down, False, shared)
        torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.02)
        assert _asked(prefetched, "_gate_up_kernel") == sorted((_lines(shared.gate) + _lines(shared.up)) * T), dtype
        assert _asked(prefetched, "_down_kernel") == sorted(_lines(shared.down) * T), dtype


def _check_attention_prefetch(prefetched: list) -> None:
    """Launched early, Inkling's decode attention asks for the key and value rows of exactly the earlier positions
    each row attends to, each once (over key splits; a window, a row without a token, a fresh row)."""
    import test_inkling_attention_kernel as cases

    from hf_qsa_cache.ops.inkling_attention_triton import paged_rel_attention_triton

    for window, splits in ((None, 3), (20, 2)):
        args, counts = cases.make_case(5, cases.DECODE_ROWS, 1, 4, 2, 16, 12, window=window)
        del prefetched[:]
        paged_rel_attention_triton(**args, block_n=8, num_splits=splits)
        want = []
        for b, (prev, count) in enumerate(cases.DECODE_ROWS):
            first = 0 if window is None else max(0, prev - window + 1)
            for pos in range(first, prev if count else first):
                slot = int(args["table"][b, pos // args["block_size"]]) * args["block_size"] + pos % args["block_size"]
                want += [store[slot, h].data_ptr() for store in (args["key_store"], args["value_store"])
                         for h in range(2)]
        assert want and _asked(prefetched, "_rel_attention_kernel") == sorted(want), window


def _emulated() -> tuple[dict, list, list]:
    """`_emulate_early_launch`, after `benchmarks/check_fused_kernels.py` is imported (it imports every kernel
    module, which copies the interpreter flag at import: bf16 dots widen)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import check_fused_kernels  # noqa: F401

    return _emulate_early_launch()


def _fused_kernels_case() -> None:
    """The fused kernels' check (`check_fused_kernels.main`, small shapes, 3 tokens) launched early: every launch
    passes the switch and the option, every program waits and triggers once, the projections kernel asks for lines
    in each program. One case: the check's own list of kernels (at least 15), run as the script runs it."""
    counts, launches, prefetched = _emulated()
    import check_fused_kernels

    rows = check_fused_kernels.main(["--device", "cpu", "--small", "--repeat", "1", "--tokens", "3"])
    assert rows and all(r["ok"] for r in rows), rows
    late = sorted({name for name, switch, option, _ in launches if not (switch and option)})
    assert not late, f"launched without the switch or the option: {late}"
    programs = sum(p for *_, p in launches)
    assert counts["wait"] == counts["trigger"] == programs, (counts, programs)
    projection_programs = sum(p for name, *_, p in launches if name == "_linears_kernel")
    assert sum(name == "_linears_kernel" for name, _ in prefetched) == projection_programs > 0
    assert {name for name, _ in prefetched} <= {"_linears_kernel", "_gate_up_kernel", "_down_kernel",
                                                "_router_logits_kernel", "_hc_down_kernel", "_hc_up_mix_kernel"}
    kernels = {name for name, *_ in launches}
    assert len(kernels) >= 15, sorted(kernels)
    print(f"early launch emulated: {len(launches)} launches of {len(kernels)} kernels, {programs} programs")


def _prefetch_case(check) -> None:
    """One kernel's prefetches, launched early (`_check_*_prefetch`)."""
    check(_emulated()[2])


KERNEL_CASES = {
    "fused-kernels-check-small-3-tokens": _fused_kernels_case,
    "projections-prefetch-their-weight-lines": partial(_prefetch_case, _check_projection_prefetch),
    "experts-prefetch-the-shared-experts-lines": partial(_prefetch_case, _check_shared_expert_prefetch),
    "router-prefetches-its-whole-weight": partial(_prefetch_case, _check_router_prefetch),
    "mixing-prefetches-its-weights": partial(_prefetch_case, _check_mixing_prefetch),
    "inkling-decode-attention-prefetches-the-rows-it-reads": partial(_prefetch_case, _check_attention_prefetch),
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernels_wait_once_per_program_when_launched_early(case):
    from helpers.interpreter import run_case_under_interpreter

    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> None:
    torch.set_num_threads(1)
    return KERNEL_CASES[case]()


if __name__ == "__main__":
    from helpers.interpreter import case_main

    sys.exit(case_main(_kernel_case))
