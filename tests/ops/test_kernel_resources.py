"""`benchmarks/kernel_resources.py`: the decode step's kernels compiled for sm_90 at the benchmark shapes, their
registers and spills read from the binary. The recorder must record a launch without running it, as the GPU's
launcher specialises it; the compiled figures must tell a spilling kernel from one that does not; and no kernel
of a one-token decode step may spill."""

from __future__ import annotations

import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "kernel_resources.py")
def _rows(*args: str) -> list[dict]:
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_no_kernel_of_a_one_token_step_spills():
    rows = _rows("--tokens", "1")
    compiled = [r for r in rows if "kernel" in r]
    assert not [r for r in compiled if "error" in r], [r for r in compiled if "error" in r]
    names = {r["kernel"] for r in compiled}
    # The decode step's kernels of every family are there (a case may stop after its launches, in host code that
    # reads the outputs the recorder left uncomputed; one that stopped before them would drop some).
    assert {"_linears_kernel", "_gate_up_kernel", "_down_kernel", "_hc_down_kernel", "_hc_up_mix_kernel",
            "_conv_add_rms_norm_kernel", "_attention_inputs_kernel", "_inkling_router_kernel", "_top_set_kernel",
            "_sparse_paged_attention_kernel", "_rel_attention_kernel", "_index_scores_kernel"} <= names
    spilling = [(r["kernel"], r["constants"]) for r in compiled if r["spill_loads"] + r["spill_stores"] > 0]
    assert not spilling, spilling
    # The kernels that stream weights at one token read them 16 bytes an access (a range length the compiler
    # cannot see as a multiple of 8 made the mixing's down projection and the router read 2 bytes at a time).
    # (The mixing's down projection in its one-token GEMV form; its dot form copies weights to shared memory.)
    weight_readers = {"_linears_kernel", "_hc_down_kernel", "_router_logits_kernel", "_gate_up_kernel"}
    narrow = [(r["kernel"], r["wide_loads"]) for r in compiled if r["kernel"] in weight_readers
              and r["constants"].get("GEMV", True) and r["wide_loads"] < 4]
    assert not narrow, narrow
    assert all(r["registers"] > 0 for r in compiled)
    # Compiled as the launcher specialises it: the keys' unit stride a constant, the token count (which the kernel
    # asks not to specialise, so that a new batch does not recompile) an argument although it is 1 here.
    attention = next(r for r in compiled if r["kernel"] == "_sparse_paged_attention_kernel")
    assert attention["constants"]["stride_kd"] == 1 and "num_tokens" not in attention["constants"]


SNIPPET = """
import json, sys
sys.path.insert(0, {benchmarks!r})
import kernel_resources  # sets the interpreter up before the kernels are imported
import torch
from hf_qsa_cache.ops import hyper_connection_triton as hct

hc, H, R = 4, 2048, 320
g = torch.Generator().manual_seed(0)
normed = torch.randn(1, hc * H, generator=g).bfloat16()
down, up = torch.randn(R, hc * H, generator=g).bfloat16(), torch.randn(hc * H, R, generator=g).bfloat16()
inject_w = torch.randn(hc, hc * H, generator=g).bfloat16()
# The one-token down projection's GEMV form keeps BLOCK_N x BLOCK_K fp32 products: 16 x 2048 on 4 warps is 256 a
# thread, more than the registers hold; the default's 8 x 1024 is 64.
too_wide = hct.MixTiles(splits=4, block_n=16, block_k=2048, down_warps=4, block_h=8, r_chunk=128, up_warps=4, gemv=True)
calls = [(name, lambda tiles=tiles: hct.mix_projections_triton(normed, down, up, inject_w, hc, tiles))
         for name, tiles in (("too wide", too_wide), ("default", None))]
for row in kernel_resources.measure(calls):
    print(json.dumps(row))
"""


def test_the_compiled_figures_tell_spills_apart():
    """The hyper-connection mixing's one-token down projection with 16 rows of 2048 products on 4 warps spills;
    with the default tiles (8 rows of 1024) it does not: one kernel, two compile-time configurations (the figures
    come from the compiler, not from the kernel's name)."""
    import json

    code = SNIPPET.format(benchmarks=os.path.join(ROOT, "benchmarks"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    down = {r["constants"]["BLOCK_N"]: r for r in rows if r.get("kernel") == "_hc_down_kernel"}
    assert set(down) == {16, 8}
    assert down[16]["spill_loads"] > 0 and down[16]["spill_stores"] > 0
    assert down[8]["spill_loads"] == down[8]["spill_stores"] == down[8]["stack_bytes"] == 0
