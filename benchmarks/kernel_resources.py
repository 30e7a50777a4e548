"""Registers and spills of the decode step's Triton kernels at the benchmark shapes, on a machine without a GPU.

    python benchmarks/kernel_resources.py                 # every kernel of the fused-kernel cases, 1 and 32 tokens
    python benchmarks/kernel_resources.py --tokens 1      # one decode token only
    python benchmarks/kernel_resources.py --pdl           # the early-launch build (HF_QSA_FUSED=...,pdl)

A kernel that needs more registers than a thread has keeps the rest in local memory ("spills"): each such load
or store is one more round trip in a kernel whose time is latency. No timing can be taken without a GPU, but
the compiler says what a kernel costs in registers: this script runs the launches of
`check_fused_kernels.py`'s cases, of the QSA decode attention and index scores and of Inkling's decode
attention at the benchmark shapes with the Triton interpreter's kernel runner replaced by a recorder (nothing
is computed: only each launch's argument types, compile-time values and launch options are kept), compiles each
distinct launch for sm_90 with Triton's own compiler (in a second process, which imports the kernels as the GPU
does), and reads the binary's resource usage and its local memory instructions (``cuobjdump``, shipped with
Triton). One JSON line per launch, the worst spills first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

# Launches are recorded under the interpreter (set before triton and the kernels are imported); the compiling
# process (``--compile``) imports them as the GPU does.
COMPILING = "--compile" in sys.argv[1:]
if not COMPILING:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from helpers.kernel_compile import compile_launch, record_into  # noqa: E402

def record_launches(calls) -> list[dict]:
    """Run ``calls`` (``(name, function)`` pairs whose functions launch kernels) with every launch of a project
    kernel recorded instead of run (`kernel_compile.record_into`); returns the distinct launches. A call that fails
    on the uncomputed outputs of an earlier launch (host code reading them) is left where it failed, its later
    launches unrecorded, and named in a line of its own."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    run = record_into(seen, execute=False)
    try:
        for name, call in calls:
            try:
                call()
            except Exception as error:  # noqa: BLE001 - reported, the other calls go on
                print(json.dumps({"case": name, "stopped": f"{type(error).__name__}: {str(error)[:200]}"}))
    finally:
        InterpretedFunction.run = run
    return list(seen.values())


def resources(entry: dict, early_launch: bool = False) -> dict:
    """Compile one recorded launch for sm_90: registers a thread, stack bytes, shared memory, the local memory
    loads and stores (spills) of its SASS, and its global loads of 16 bytes (``wide_loads``: 8 bf16 values in one
    access) and of 1 or 2 bytes (``narrow_loads``: one value an access, where the compiler could not tell that
    neighbours are contiguous and aligned). ``early_launch``: the build the ``pdl`` setting launches (its
    wait, trigger and weight prefetches; the interpreter records the other)."""
    import triton.backends.nvidia as nvidia

    compiled = compile_launch(entry, early_launch)
    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    registers, stack, shared, local = (int(x) for x in found.groups())
    return {"registers": registers, "stack_bytes": stack, "shared_bytes": shared, "local_bytes": local,
            "spill_loads": len(re.findall(r"\bLDL(\.\w+)*\s", sass)),
            "spill_stores": len(re.findall(r"\bSTL(\.\w+)*\s", sass)),
            "wide_loads": len(re.findall(r"\bLDG(\.\w+)*\.128\b", sass)),
            "narrow_loads": len(re.findall(r"\bLDG(\.\w+)*\.[US](8|16)\b", sass))}


def fused_kernel_calls(tokens: int):
    """`check_fused_kernels.py`'s kernels at the benchmark shapes, ``tokens`` tokens a step."""
    import check_fused_kernels

    for name, kernel, _spec, _tol in check_fused_kernels.cases(torch.device("cpu"), torch.bfloat16, tokens, False):
        yield f"{name} ({tokens} tokens)", kernel


def attention_calls(tokens: int):
    """The QSA layer's decode attention and index scores, and Inkling's decode attention (both layer kinds)."""
    import check_inkling_attention
    import check_qsa_kernels

    from hf_qsa_cache.ops import qsa_triton
    from hf_qsa_cache.ops.inkling_attention_triton import paged_rel_attention_triton

    g = torch.Generator().manual_seed(0)
    args = check_qsa_kernels._attention_args(tokens, torch.bfloat16, g, "cpu")
    yield f"QSA sparse attention ({tokens} tokens)", lambda: qsa_triton.sparse_paged_attention_triton(*args)
    heads, dim, groups = 32, 128, 4096
    table, num_blocks = check_qsa_kernels._table(g, "cpu", 1, groups * check_qsa_kernels.RATIO)
    rows_per_block = check_qsa_kernels.BLOCK_SIZE // check_qsa_kernels.RATIO
    q_index = torch.randn(tokens, heads, dim).bfloat16()
    compressed = torch.randn(num_blocks, rows_per_block, dim).bfloat16()
    token_row = torch.zeros(tokens, dtype=torch.int32)
    visible = torch.full((tokens,), groups, dtype=torch.int32)
    yield f"QSA index scores ({tokens} tokens)", lambda: qsa_triton.index_scores_triton(
        q_index, compressed, table, token_row, visible, rows_per_block, groups)
    for layer in ("full", "sliding"):
        inputs = check_inkling_attention.make_inputs(layer, [(16384 if tokens == 1 else 2048, 1)] * tokens,
                                                     torch.bfloat16, "cpu")
        yield f"Inkling {layer} attention ({tokens} tokens)", lambda i=inputs: paged_rel_attention_triton(**i)


def compile_all(launches: list[dict], early_launch: bool = False) -> list[dict]:
    """`resources` of each launch (in the ``--compile`` process), the worst spills first."""
    rows = []
    for entry in launches:
        # (WIDEN, the interpreter's switch, is compiled off: `kernel_compile.compile_launch`)
        sizes = {k: v for k, v in entry["constants"].items() if not isinstance(v, dict) and k != "WIDEN"}
        row = {"kernel": entry["name"], **entry["options"], "constants": sizes, "early_launch": early_launch}
        try:
            row.update(resources(entry, early_launch))
        except Exception as error:  # noqa: BLE001 - a launch that does not compile is reported, not fatal
            row["error"] = f"{type(error).__name__}: {str(error)[-300:]}"
        rows.append(row)
    return sorted(rows, key=lambda r: -(r.get("spill_loads", 0) + r.get("spill_stores", 0)))


def measure(calls, early_launch: bool = False) -> list[dict]:
    """Record the launches of ``calls`` here, compile them in a process of their own: the rows of
    `compile_all`."""
    launches = record_launches(calls)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in launches)
        f.flush()
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        command = [sys.executable, os.path.abspath(__file__), "--compile", f.name] + (["--pdl"] if early_launch else [])
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--pdl", action="store_true", help="compile the early-launch build of each kernel")
    parser.add_argument("--compile", help=argparse.SUPPRESS)  # the second process: a file of recorded launches
    args = parser.parse_args(argv)
    if args.compile:
        with open(args.compile) as f:
            rows = compile_all([json.loads(line) for line in f if line.strip()], args.pdl)
    else:
        # Each case's inputs are built as its generator reaches it (a later case may rebind the names an earlier
        # call reads), so the calls are made as they come.
        rows = measure((call for tokens in args.tokens
                        for call in itertools.chain(fused_kernel_calls(tokens), attention_calls(tokens))), args.pdl)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
