"""Host time of the prefix cache's eviction once the pool is full of idle cached blocks (CPU, no model).

    python benchmarks/profile_prefix_eviction.py --entries 20000

A block table of ``--entries`` + 1 blocks holds one idle cached prefix of one unit in each block (a server whose
pool has filled with cached prefixes); then a row grows one block a step for ``--steps`` steps, each step first
asking the prefix cache for room (`PrefixCache.make_room_for`, as a step's transaction does). Printed: the host
milliseconds a step and the entries evicted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_qsa_cache.blocks import BlockTable  # noqa: E402
from hf_qsa_cache.prefix_cache import PrefixCache  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=4)
    args = parser.parse_args(argv)
    size = args.block_size
    table = BlockTable("main", args.entries + 1, size, max_rows=2, max_len=size * (args.entries + args.steps))
    cache = PrefixCache({"main": table}, size, None, None, None)
    for i in range(args.entries):  # one-unit prefixes, each cached, then idle
        table.reserve(0, size)
        cache.insert({"main": table.rows[0]}, [i] * size, size, None)
        table.release_row(0)
    start = time.perf_counter()
    for k in range(args.steps):  # row 1 takes one more block each step
        cache.make_room_for([0, size * (k + 1)])
        table.reserve(1, size * (k + 1))
    ms = 1e3 * (time.perf_counter() - start) / args.steps
    result = {"entries": args.entries, "steps": args.steps, "ms_per_step": ms,
              "evicted": args.entries - len(cache.entries)}
    print(f"{args.entries} idle cached entries, {args.steps} steps of one new block: {ms:.3f} ms a step, "
          f"{result['evicted']} entries evicted")
    return result


if __name__ == "__main__":
    main()
