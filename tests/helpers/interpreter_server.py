"""Runs the test suite's interpreter scripts, one forked child per script, the heavy imports paid once.

Started by `interpreter.run_under_interpreter` with ``TRITON_INTERPRET=1`` (it must be set before triton is first
imported). It imports torch, triton, transformers and this project once (about 6 s, which every script paid
again when each ran in a fresh Python), and pytest and the tests' helpers (which every test file imports: a
child running one case pays only its own work), then serves requests read from stdin, one JSON line each: ``script``,
``args``, ``log`` (where `kernel_compile.record` writes the script's launches) and ``out`` (its stdout and
stderr). For each it forks: the child starts from the imported modules, untouched by earlier scripts (each child
exits when its script ends), runs the script as ``__main__`` and writes its launch log; the server replies with
the child's exit status on one line.

Scripts see the environment the test process had when it started the server (the project's modules read theirs,
`HF_QSA_FUSED` among it, at import). The server itself runs no torch op (a forked child must not inherit a
running OpenMP pool) and keeps torch on one thread.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

import torch

torch.set_num_threads(1)

import triton  # noqa: E402,F401
import transformers  # noqa: E402,F401

import hf_qsa_cache  # noqa: E402,F401

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: `helpers`
from helpers import kernel_compile  # noqa: E402
import modeling  # noqa: E402,F401

# What every test file imports at its top, so that a child running one case of it does not import them again
# (pytest alone took 60 ms of a short case's 150).
import pytest  # noqa: E402,F401
from helpers import fusions, inkling, interpreter, qwen4  # noqa: E402,F401


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter swaps triton.language's functions for its own at each launch, and again at every call of
    a device function (a helper, ``tl.sum`` or ``tl.max`` and their combine functions: per program, per loop round)
    while the launch's swap is in place, putting back the same functions (it wraps only the originals): up to half
    of a case's time. Here a device function's call swaps only the modules the running launch has not swapped yet
    (``tl.sum``'s module sees ``core``, a kernel ``tl``), as the interpreter's first such call does; what runs is
    unchanged (a function that sees neither still goes to the interpreter, which refuses it)."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as interp

    if not hasattr(interp, "_patch_lang"):  # another Triton: its interpreter as it is (slower, same results)
        return
    swap, launch = interp._patch_lang, interp.GridExecutor.__call__
    swapped: list = []  # per running launch: the language modules swapped in it (None until the launch's own)

    def modules(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        mine = modules(fn)
        if mine and swapped and swapped[-1] is not None and mine <= swapped[-1]:
            return None  # a device function's call (its caller ignores the scope): already in place
        scope = swap(fn)
        if swapped:
            swapped[-1] = (swapped[-1] or set()) | mine
        return scope

    def run_launch(self, *args, **kwargs):
        swapped.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            swapped.pop()

    interp._patch_lang, interp.GridExecutor.__call__ = patch_lang, run_launch


_patch_language_once_per_launch()


def _run_child(request: dict) -> None:
    """In the forked child: the script with its output to ``out``, then its launch log; never returns."""
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.environ[kernel_compile.LOG_VARIABLE] = request["log"]
    write_log = kernel_compile.record(request["log"])
    status = 0
    try:
        sys.argv = [request["script"], *request["args"]]
        sys.path.insert(0, os.path.dirname(request["script"]))  # as `python script` would: its folder's modules
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the script's output, as a fresh Python would
        traceback.print_exc()
        status = 1
    try:
        write_log()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # not the server's exit handlers


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        _, wait_status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(wait_status), flush=True)


if __name__ == "__main__":
    main()
