"""`benchmarks/kernel_resources.py`: the decode step's kernels compiled for sm_90 at the benchmark shapes, their
registers and spills read from the binary. The recorder must record a launch without running it; the compiled
figures must tell a spilling kernel from one that does not; and no kernel of a one-token decode step may spill
but the two attention kernels known to (at their present tiles: `qsa_triton.ATTENTION_DECODE_BLOCK_W`, Inkling's
`DECODE_BLOCK_N`), whose tiles await a GPU sweep."""

from __future__ import annotations

import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "kernel_resources.py")
KNOWN_TO_SPILL = {"_sparse_paged_attention_kernel", "_rel_attention_kernel"}


def _rows(*args: str) -> list[dict]:
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_only_the_known_attention_kernels_spill_in_a_one_token_step():
    rows = _rows("--tokens", "1")
    compiled = [r for r in rows if "kernel" in r]
    assert not [r for r in compiled if "error" in r], [r for r in compiled if "error" in r]
    names = {r["kernel"] for r in compiled}
    # The decode step's kernels of every family are there (a case may stop after its launches, in host code that
    # reads the outputs the recorder left uncomputed; one that stopped before them would drop some).
    assert {"_linears_kernel", "_gate_up_kernel", "_down_kernel", "_hc_down_kernel", "_hc_up_mix_kernel",
            "_conv_add_rms_norm_kernel", "_attention_inputs_kernel", "_inkling_router_kernel", "_top_set_kernel",
            "_sparse_paged_attention_kernel", "_rel_attention_kernel", "_index_scores_kernel"} <= names
    spilling = {r["kernel"] for r in compiled if r["spill_loads"] + r["spill_stores"] > 0}
    assert spilling <= KNOWN_TO_SPILL, sorted(spilling - KNOWN_TO_SPILL)
    assert all(r["registers"] > 0 for r in compiled)


SNIPPET = """
import json, sys
sys.path.insert(0, {benchmarks!r})
import kernel_resources  # sets the interpreter up before the kernels are imported
import torch
import check_qsa_kernels
from hf_qsa_cache.ops import qsa_triton

args = check_qsa_kernels._attention_args(1, torch.bfloat16, torch.Generator().manual_seed(0), "cpu")
calls = []
for block_w in (64, 16):
    def call(block_w=block_w):
        qsa_triton.ATTENTION_DECODE_BLOCK_W = block_w
        qsa_triton.sparse_paged_attention_triton(*args)
    calls.append((f"tile {{block_w}}", call))
for row in kernel_resources.measure(calls):
    print(json.dumps(row))
"""


def test_the_compiled_figures_tell_spills_apart():
    """The QSA decode attention at tiles of 64 positions and 4 warps spills; at 16, it does not (one kernel, two
    compile-time sizes: the figures come from the compiler, not from the kernel's name)."""
    import json

    code = SNIPPET.format(benchmarks=os.path.join(ROOT, "benchmarks"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    attention = {r["constants"]["BLOCK_W"]: r for r in rows if r.get("kernel") == "_sparse_paged_attention_kernel"}
    assert set(attention) == {64, 16}
    assert attention[64]["spill_loads"] > 0 and attention[64]["spill_stores"] > 0
    assert attention[16]["spill_loads"] == attention[16]["spill_stores"] == attention[16]["stack_bytes"] == 0
