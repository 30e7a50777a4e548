"""Run a test file as a script under the Triton interpreter.

TRITON_INTERPRET must be set before `triton` is first imported, and other tests in the same pytest
process import it earlier, so kernel-vs-reference comparisons run in a process of their own: a child forked
by `interpreter_server`, which imported torch, triton, transformers and the project once for the whole test
run (each script paid those 6 s of imports again when it started a fresh Python).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from helpers import kernel_compile

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_under_interpreter(script: str, expect: str, timeout: int = 600, args: tuple[str, ...] = ()) -> None:
    """Run ``script`` (with ``args``) with TRITON_INTERPRET=1; fail unless it exits 0 and prints ``expect``,
    and unless every project kernel it launched also compiles for the GPU (`kernel_compile`). The script runs
    in a child forked by this process's `interpreter_server` (imports paid once per test process)."""
    with tempfile.TemporaryDirectory() as tmp:
        log, out = os.path.join(tmp, "launches.jsonl"), os.path.join(tmp, "output.txt")
        status = _server().run(str(Path(script).resolve()), args, log, out, timeout)
        with open(out) as f:
            output = f.read()
        assert status == 0, f"{Path(script).name} under the interpreter failed:\n{output}"
        assert expect in output, output
        if os.environ.get("TRITON_INTERPRET") != "1":  # this process has Triton's compiler, not the interpreter
            assert kernel_compile.compile_logged(log, _COMPILED) > 0, f"{Path(script).name} launched no project kernel"


# The launch structures this test process has compiled already (`kernel_compile.structure`): each is compiled once
# however many scripts or cases launch it.
_COMPILED: set[str] = set()


def run_case_under_interpreter(script: str, case: str, timeout: int = 600) -> None:
    """Run one case of a kernel test file under the interpreter (`run_under_interpreter`): the file, run with
    ``--case NAME``, runs that case alone (`case_main`) and prints ``case NAME ok``. A pytest item per case, each a
    forked child of the one interpreter server."""
    run_under_interpreter(script, f"case {case} ok", timeout, args=("--case", case))


def case_main(run) -> int:
    """A kernel test file's ``__main__`` under the interpreter: the case named after ``--case``, from ``run``: a
    mapping of case ids to functions of no argument, or a function of the id (each returns None, or what
    differs); prints ``case NAME ok`` when it passes."""
    import sys

    case = sys.argv[sys.argv.index("--case") + 1]
    error = run[case]() if isinstance(run, dict) else run(case)
    if error:
        print(f"case {case}: {error}")
        return 1
    print(f"case {case} ok")
    return 0


class _Server:
    """The `interpreter_server` process: one request at a time, its reply (the script's exit status) awaited
    for at most the script's timeout."""

    def __init__(self):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        server = Path(__file__).with_name("interpreter_server.py")
        # A session of its own: closing kills the server with the script child it may be waiting for.
        self.proc = subprocess.Popen([sys.executable, str(server)], env=env, cwd=str(REPO_ROOT),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def run(self, script: str, args, log: str, out: str, timeout: float) -> int:
        request = {"script": script, "args": list(args), "log": log, "out": out}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        reply = self.proc.stdout.readline() if ready else ""
        if not reply.strip():
            self.close()
            raise AssertionError(f"{Path(script).name} under the interpreter: no result within {timeout} s "
                                 f"(server exit status {self.proc.returncode})")
        return int(reply)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


_SERVER: list[_Server] = []


def _server() -> _Server:
    if not _SERVER or _SERVER[0].proc.poll() is not None:
        _SERVER[:] = [_Server()]
        atexit.register(_SERVER[0].close)
    return _SERVER[0]


def count_launches(module, name: str, launches: list) -> None:
    """Replace the Triton kernel ``module.name`` with a wrapper that appends each launch's grid to ``launches``
    (for a script running under the interpreter: how many launches an op makes)."""
    kernel = getattr(module, name)

    class _Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    setattr(module, name, _Counting())
