"""benchmarks/profile_http_server.py at tiny sizes: the server profiled in-process, a client process streams."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_profile_http_server_runs_and_reports():
    from helpers.http_server import free_port

    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "profile_http_server.py"), "--streams", "3",
                          "--tokens", "4", "--rounds", "1", "--top", "3", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "round:" in out.stdout and "Python function calls per streamed token" in out.stdout
