"""Writing a step's ids into the token log (`hf_qsa_cache.ops.token_log`): the specification against a loop over
the tokens, the dispatch, and under the Triton interpreter (as a script, `interpreter.py`) the kernel against the
specification and a generate() whose log the kernel writes against the default's."""

from __future__ import annotations

import sys
from functools import partial

import pytest
import torch
from helpers.interpreter import case_main, count_launches, run_case_under_interpreter

from hf_qsa_cache import fusions
from hf_qsa_cache.ops import token_log


def _case(seed: int, rows: int, width: int, max_len: int = 40):
    """A log ``[rows + 1, max_len]`` already holding ids, and one step's ids ``[rows, width]`` with their positions
    (left pads: -1) and rows, as the step metadata gives them."""
    g = torch.Generator().manual_seed(seed)
    log = torch.randint(0, 1000, (rows + 1, max_len), generator=g, dtype=torch.int32)
    ids = torch.randint(0, 50000, (rows, width), generator=g)
    prev = torch.randint(0, max_len - width, (rows,), generator=g)
    real = torch.randint(0, width + 1, (rows,), generator=g)
    prev[0], real[0] = 0, width  # a row's first tokens: position 0 is a real one
    col = torch.arange(width)
    position = torch.where(col >= width - real[:, None], prev[:, None] + col - (width - real[:, None]), -1)
    token_row = torch.arange(rows).repeat_interleave(width).to(torch.int32)
    return log, position.reshape(-1), token_row, ids


def test_the_specification_writes_each_real_token_at_its_row_and_position():
    log, position, token_row, ids = _case(0, rows=5, width=4)
    want = log.clone()
    for i, (p, r) in enumerate(zip(position.tolist(), token_row.tolist())):
        if p >= 0:
            want[r, p] = int(ids.reshape(-1)[i])
    got = log.clone()
    token_log.log_tokens_torch(got, position, token_row, ids)
    assert torch.equal(got[:-1], want[:-1])  # the last row takes the pads (never read)
    assert (position < 0).any() and (position >= 0).any()


def test_the_write_goes_to_the_kernel_only_with_the_fusion_on_and_on_cuda(monkeypatch):
    log, position, token_row, ids = _case(2, rows=2, width=3)
    calls = []
    monkeypatch.setattr(token_log, "log_tokens_torch", lambda *a: calls.append("torch"))
    import hf_qsa_cache.ops.token_log_triton as kernel

    monkeypatch.setattr(kernel, "log_tokens_triton", lambda *a: calls.append("kernel"))
    for on, cuda in ((True, False), (False, True), (True, True)):
        monkeypatch.setitem(fusions.STATE, "token_log", on)
        monkeypatch.setattr(token_log, "use_triton", lambda t, cuda=cuda: cuda)
        token_log.log_tokens(log, position, token_row, ids)
    assert calls == ["torch", "torch", "kernel"]


def test_the_kernel_refuses_mismatched_inputs():
    from hf_qsa_cache.ops.token_log_triton import log_tokens_triton

    log, position, token_row, ids = _case(1, rows=2, width=3)
    with pytest.raises(ValueError, match="one position and one row per token: 5 ids, 6 positions"):
        log_tokens_triton(log, position, token_row, ids.reshape(-1)[:5])
    with pytest.raises(ValueError, match="contiguous int32"):
        log_tokens_triton(log.long(), position, token_row, ids)


def _counted_launches() -> list:
    from hf_qsa_cache.ops import token_log_triton

    launches: list = []
    count_launches(token_log_triton, "_log_tokens_kernel", launches)
    return launches


def _write_case(seed: int, rows: int, width: int) -> str | None:
    """The kernel (blocks of 4 tokens: several programs, the last one partly masked) against the specification:
    the same log, ceil(tokens / 4) programs."""
    from hf_qsa_cache.ops import token_log_triton

    launches = _counted_launches()
    token_log_triton.BLOCK = 4
    log, position, token_row, ids = _case(seed, rows, width)
    want, got = log.clone(), log.clone()
    token_log.log_tokens_torch(want, position, token_row, ids)
    token_log_triton.log_tokens_triton(got, position, token_row, ids)
    if not torch.equal(got[:-1], want[:-1]):
        return "the logs differ"
    if launches != [(-(-rows * width // 4),)]:
        return f"launches {launches}"
    return None


def _generate_case() -> str | None:
    """A model's generate() with the kernel writing its log (on CPU tensors): the log a default run leaves, and a
    continuation that does not start with the held tokens is still refused."""
    import helpers.inkling as inkling

    from hf_qsa_cache import QSAPagedCache

    launches = _counted_launches()
    _, model = inkling.make_pair(inkling.make_config(), seed=4)
    ids, mask = inkling.left_pad(inkling.make_prompts([9, 4], seed=5))
    logs = {}
    for fused in (False, True):
        fusions.STATE["token_log"] = fused
        token_log.use_triton = lambda *log: True
        launches.clear()
        cache = QSAPagedCache(model.config, 2, 32)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                 past_key_values=cache)
            if bool(launches) != fused:
                return f"fused={fused}: {len(launches)} kernel launches"
            logs[fused] = cache.token_log.ids.clone()
            wrong = out.clone()
            wrong[0, -2] += 1
            try:
                model.generate(torch.cat([wrong, wrong[:, -1:]], 1), max_new_tokens=1, do_sample=False,
                               pad_token_id=0, past_key_values=cache,
                               attention_mask=torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], 1))
                return f"fused={fused}: a wrong continuation was not refused"
            except ValueError as err:
                if "does not start with the tokens the cache holds" not in str(err):
                    raise
    if not torch.equal(logs[True][:-1], logs[False][:-1]):
        return "the kernel's log differs from the default's"
    return None


KERNEL_CASES = {
    **{f"block4-{rows}rows-width{width}": partial(_write_case, seed, rows, width)
       for seed, (rows, width) in enumerate([(1, 1), (3, 5), (4, 1), (2, 7)])},
    "generate": _generate_case,
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernel_matches_torch(case):
    run_case_under_interpreter(__file__, case)


if __name__ == "__main__":
    sys.exit(case_main(KERNEL_CASES))
