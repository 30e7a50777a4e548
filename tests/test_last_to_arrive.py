"""`triton_common.last_to_arrive`: a launch's last step run by the last of its programs to finish.

Under the Triton interpreter (programs run one after another): in a launch of several programs per token, exactly
one program per token is told it is last, after every other program of that token stored its part, so it sums them
all; the counters are back at 0 after the launch, so the next launch on them works as well.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from interpreter import run_under_interpreter

from hf_qsa_cache.ops.triton_common import arrival_counters, last_to_arrive


@triton.jit
def _sum_parts_kernel(part_ptr, out_ptr, fired_ptr, count_ptr, PARTS: tl.constexpr):
    """Programs (a, b, t) store part a * B + b of token t; the token's last program sums its parts and counts
    itself in ``fired``."""
    a, b, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    part = a * tl.num_programs(1) + b
    tl.store(part_ptr + t * PARTS + part, (t * 100 + part).to(tl.float32))
    if last_to_arrive(count_ptr + t, tl.num_programs(0) * tl.num_programs(1)):
        parts = tl.load(part_ptr + t * PARTS + tl.arange(0, PARTS), cache_modifier=".cg")
        tl.store(out_ptr + t, tl.sum(parts, axis=0))
        tl.atomic_add(fired_ptr + t, 1)


def test_one_program_per_token_is_last_and_sees_every_part():
    run_under_interpreter(__file__, "last_to_arrive ok")


def _main() -> int:
    counters = arrival_counters(torch.device("cpu"))
    for tokens, (a, b) in ((1, (4, 2)), (16, (2, 4)), (3, (1, 1))):
        parts = torch.zeros(tokens, a * b)
        out = torch.full((tokens,), -1.0)
        fired = torch.zeros(tokens, dtype=torch.int32)
        _sum_parts_kernel[(a, b, tokens)](parts, out, fired, counters, PARTS=a * b)
        want = torch.tensor([sum(t * 100 + p for p in range(a * b)) for t in range(tokens)], dtype=torch.float32)
        assert torch.equal(out, want), (tokens, a, b, out, want)
        assert fired.tolist() == [1] * tokens, (tokens, a, b, fired)
        assert not counters.any(), counters
    # A project kernel that routes in its last programs, on the same counters after the launches above.
    from hf_qsa_cache.ops import router
    from hf_qsa_cache.ops.router_triton import route_triton

    x, weight = torch.randn(2, 64), torch.randn(16, 64)
    have, want = route_triton(x, weight, 4, True, split=True, block_h=16), router.route_torch(x, weight, 4, True)
    assert torch.equal(have[1], want[1]) and torch.allclose(have[0], want[0], atol=1e-6), (have, want)
    assert not counters.any(), counters
    print("last_to_arrive ok")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(_main())
