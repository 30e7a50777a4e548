"""Every Triton kernel a test runs under the interpreter is also compiled for the GPU it is written for.

The interpreter runs a kernel as Python on the CPU, so it accepts code that Triton's compiler refuses (a
name rebound from a compile-time constant to a tensor, a constexpr mismatch between branches): such a kernel
passes every interpreter test and fails at its first launch on a GPU. So each interpreter run records its
launches (`record` below, in the subprocess, writing one JSON line per distinct launch), and the test
process compiles them for an sm_90 target (the H200) with Triton's real compiler, down to the binary: one
launch per kernel, argument types and compile-time values other than integer sizes (`structure`: a test's
many small shapes compile alike). No GPU is needed: the compiler and its assembler ship with Triton. A kernel
that takes the ``PDL`` switch (`hf_qsa_cache.ops.triton_common.pdl`) is compiled with it on, the build the GPU
runs with early launch: the same code plus its wait, trigger and prefetches.

A launch record: the kernel's module and name, the type of each runtime argument (a tensor's element
type, an int's width), the value of each compile-time argument, the launch options (warps, stages), and what
Triton's launcher on the GPU derives from the argument values (`specialization`): an integer argument equal
to 1 becomes a compile-time 1, and an integer or pointer divisible by 16 is marked so (``"D"``), unless the
kernel's ``do_not_specialize`` / ``do_not_specialize_on_alignment`` names it. These change the code: a
stride known to be 1 and a 16-byte aligned pointer let a load be one vector instruction instead of one per
element, which decides a kernel's registers and spills (`benchmarks/kernel_resources.py`).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import sys

LOG_VARIABLE = "HF_QSA_KERNEL_LAUNCH_LOG"
TARGET_ARCH = 90  # H200 / H100
LAUNCH_OPTIONS = ("num_warps", "num_stages")
PROJECT_PACKAGES = ("hf_qsa_cache", "modeling")


def _constant(value):
    """A compile-time argument as JSON (Triton dtypes by name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"dtype": str(value)}


def specialization(value, specialize: bool = True, align: bool = True) -> tuple[str, str | int | None]:
    """What Triton's launcher on the GPU makes of a runtime argument's value: ``("constexpr", 1)`` for an integer
    equal to 1 (with ``specialize``), else ``(type, "D")`` where an integer or a tensor's address is divisible by
    16 (with ``align``), or ``(type, "")``. The launcher's own function, called as the GPU's launcher calls it."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    kind, attr = native_specialize_impl(BaseBackend, value, False, specialize, align)[:2]
    return kind, attr if kind == "constexpr" else (attr or "")


def _names(params: list[str], listed) -> set[str]:
    """A kernel's ``do_not_specialize``-style list (names or positions) as names."""
    return {params[x] if isinstance(x, int) else x for x in (listed or ())}


def launch_record(fn, arg_names: list[str], args: tuple, kwargs: dict, jit_options: dict | None = None) -> dict:
    """The record of one launch of kernel function ``fn`` (the undecorated Python function); ``jit_options``:
    the keywords of its ``triton.jit`` decorator (``do_not_specialize`` ...)."""
    import inspect

    import triton.language as tl

    params = inspect.signature(fn).parameters
    names = list(params)
    jit_options = jit_options or {}
    fixed = _names(names, jit_options.get("do_not_specialize"))
    unaligned = _names(names, jit_options.get("do_not_specialize_on_alignment"))
    bound = dict(zip(arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    signature, constants, attrs = {}, {}, {}
    for name, param in params.items():
        value = bound.get(name, param.default)
        if param.annotation is tl.constexpr or param.annotation == "tl.constexpr":
            constants[name] = _constant(value)
            continue
        kind, attr = specialization(value, name not in fixed, name not in unaligned)
        if kind == "constexpr":
            constants[name] = attr
            continue
        signature[name] = kind
        if attr:
            attrs[name] = attr
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constants": constants,
            "attrs": attrs, "options": {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}}


def record_into(seen: dict[str, dict], execute: bool = True):
    """Under the interpreter: add each distinct launch of a project kernel to ``seen`` (its JSON -> the record), and
    run it unless ``execute`` is False (then nothing is computed: its outputs stay as allocated). Returns the
    interpreter's own runner, for the caller to put back."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.split(".")[0] not in PROJECT_PACKAGES:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        entry = launch_record(self.fn, self.arg_names, args, kwargs, self.kwargs)
        seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs) if execute else None

    InterpretedFunction.run = recording_run
    return run


def record(path: str):
    """Under the interpreter: log each distinct launch of this process to ``path`` when it exits (or when the
    returned function is called: a forked child that leaves without the exit handlers)."""
    seen: dict[str, dict] = {}
    record_into(seen)

    def write():
        with open(path, "a") as f:
            for line in seen:
                f.write(line + "\n")

    atexit.register(write)
    return write


def _compile_constant(value):
    if isinstance(value, dict):
        import triton.language as tl

        return tl.dtype(value["dtype"])
    return value


def compile_launch(entry: dict, early_launch: bool = True):
    """Triton's compiled kernel of one recorded launch, for an sm_90 target, as the GPU runs it; raises the
    compiler's error if it does not compile. A ``WIDEN`` switch (bf16 dot operands widened to fp32, for the
    interpreter only) is compiled off. The interpreter never launches early: with ``early_launch`` a kernel that
    takes the ``PDL`` switch is compiled with it on (its code plus the wait, which the GPU runs with the ``pdl``
    setting on)."""
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(entry["module"]), entry["name"])
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    constants = {name: _compile_constant(v) for name, v in entry["constants"].items()}
    options = dict(entry["options"])
    if "WIDEN" in constants:
        constants["WIDEN"] = False
    if early_launch and "PDL" in constants:
        constants["PDL"] = True
        options["launch_pdl"] = True
    # In the kernel's parameter order, as the launcher builds it; the launcher's alignment marks as attributes.
    signature = {name: "constexpr" if name in constants else entry["signature"][name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): BaseBackend.parse_attr(attr) for name, attr in entry["attrs"].items()}
    source = ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", TARGET_ARCH, 32), options=options)


def compile_for_gpu(entry: dict) -> None:
    """Compile one recorded launch, its early-launch build, for an sm_90 target (`compile_launch`)."""
    compile_launch(entry)


def structure(entry: dict) -> str:
    """What decides whether a kernel compiles, short of sizes: launches that differ only in integer
    compile-time sizes (a test's many small shapes) compile alike, and one of them is compiled."""
    constants = {k: v for k, v in entry["constants"].items() if isinstance(v, bool) or not isinstance(v, int)}
    return json.dumps({**entry, "constants": constants}, sort_keys=True)


def compile_logged(path: str, done: set[str] | None = None) -> int:
    """Compile every launch logged at ``path`` (but those whose `structure` is in ``done``, which gets the ones
    compiled here); fails naming each kernel that does not compile. Returns how many distinct launches it read."""
    with open(path) as f:
        entries = {structure(e): e for e in map(json.loads, filter(str.strip, f))}
    done = set() if done is None else done
    failures = []
    for key, entry in entries.items():
        if key in done:
            continue
        try:
            compile_for_gpu(entry)
            done.add(key)
        except Exception as error:  # noqa: BLE001 - every failure is reported below
            failures.append(f"{entry['module']}.{entry['name']} {entry['constants']}: "
                            f"{type(error).__name__}: {str(error)[-1500:]}")
    assert not failures, "kernels that pass the interpreter but do not compile for sm_90:\n" + "\n".join(failures)
    return len(entries)


if __name__ == "__main__":  # python kernel_compile.py SCRIPT ARGS...: run SCRIPT recording its launches
    record(os.environ[LOG_VARIABLE])
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
