"""Run a test file as a script under the Triton interpreter.

TRITON_INTERPRET must be set before `triton` is first imported, and other tests in the same pytest
process import it earlier, so kernel-vs-reference comparisons run in a fresh Python process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import kernel_compile

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_under_interpreter(script: str, expect: str, timeout: int = 600, args: tuple[str, ...] = ()) -> None:
    """Run ``script`` (with ``args``) with TRITON_INTERPRET=1; fail unless it exits 0 and prints ``expect``,
    and unless every project kernel it launched also compiles for the GPU (`kernel_compile`)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "launches.jsonl")
        env = {**os.environ, "TRITON_INTERPRET": "1", kernel_compile.LOG_VARIABLE: log}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        proc = subprocess.run([sys.executable, kernel_compile.__file__, str(Path(script).resolve()), *args],
                              env=env, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, (f"{Path(script).name} under the interpreter failed:\n"
                                      f"{proc.stdout}\n{proc.stderr}")
        assert expect in proc.stdout, proc.stdout
        if os.environ.get("TRITON_INTERPRET") != "1":  # this process has Triton's compiler, not the interpreter
            assert kernel_compile.compile_logged(log) > 0, f"{Path(script).name} launched no project kernel"


def count_launches(module, name: str, launches: list) -> None:
    """Replace the Triton kernel ``module.name`` with a wrapper that appends each launch's grid to ``launches``
    (for a script running under the interpreter: how many launches an op makes)."""
    kernel = getattr(module, name)

    class _Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    setattr(module, name, _Counting())
