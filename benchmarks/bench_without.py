"""Time Inkling's decode step with some of its fused launches replaced by nothing: an upper bound on what removing
those launches could save. The outputs are wrong on purpose (routing and attention see other values), so only the
step's time means anything.

    python benchmarks/bench_without.py --drop conv_add_rms_norm attention_inputs -- \\
        --model inkling --layers 6 --cases 1x16384 --graphs on --skip-upstream --loops ours --end-to-end-calls 10

Everything after ``--`` goes to `bench_generate.py`. The dropped ops:

* ``conv_add_rms_norm``: the conv, residual add and norm between the blocks (two launches a layer) return their
  input as both the residual and the normed value;
* ``attention_inputs``: the query norm and the key and value convs (one launch a layer) return their inputs.

Used to decide whether folding a launch into its neighbours is worth building (benchmarks/RESULTS.md: dropping the
twelve ``conv_add_rms_norm`` launches of a 6-layer step saved 42 us of 467 on an H100, which the fold into the
projections did not come near).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_qsa_cache.ops.conv_norm as conv_norm  # noqa: E402

# name -> what Inkling's layers run instead (same arguments, the inputs returned): the names are the functions of
# `hf_qsa_cache.ops.conv_norm` that its dispatch (`conv_add_norm`, `normed_attention_inputs`) calls.
DROPS = {
    "conv_add_rms_norm": lambda x, taps, residual, norm: (x, x),
    "attention_inputs": lambda q, k, v, *rest: (q, k, v),
}


@contextlib.contextmanager
def dropped(names):
    """Within the block, the Inkling layers call nothing for the ops ``names`` (keys of `DROPS`)."""
    unknown = set(names) - set(DROPS)
    if unknown:
        raise ValueError(f"unknown op(s) {sorted(unknown)}; known: {', '.join(DROPS)}")
    saved = {name: getattr(conv_norm, name) for name in names}
    try:
        for name in names:
            setattr(conv_norm, name, DROPS[name])
        yield
    finally:
        for name, real in saved.items():
            setattr(conv_norm, name, real)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drop", nargs="+", required=True, choices=sorted(DROPS))
    args = parser.parse_args(argv[:split])
    import bench_generate

    sys.argv = ["bench_generate.py", *argv[split + 1:]]
    with dropped(args.drop):
        bench_generate.main()


if __name__ == "__main__":
    main()
