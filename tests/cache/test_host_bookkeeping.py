"""The host bookkeeping of a step and of row placement stays right where it does less work.

* `BlockTable` under a seeded random sequence of what the cache does to it (steps that reserve and then
  commit or roll back, continuous batching's row moves, row copies, crops, releases, growth, resets): after
  every operation the device table equals the host rows, entries below a row's ``base`` are null, every block
  is held once or free, a move hands each row exactly its source's blocks, a rolled-back step leaves the
  table as it was, and a committed step has released what fell out of the window;
* moving a row costs its live blocks, not its length (windowed tables keep a long null prefix);
* an eager multi-token step with a padding mask reads the mask to the host once (`padding.host_step_columns`
  shared by `step_order` and the cache's check), and a mask changed in place is read again;
* the scheduler keeps decoding requests in their rows: one finishing or one starting to decode moves at
  most one other.
"""

from __future__ import annotations

import random

import pytest
import torch
import helpers.inkling as inkling
from helpers.qwen4 import make_pair as qwen_pair
from torch.utils._pytree import tree_flatten, tree_map
from transformers.generation.continuous_batching.requests import RequestStatus

from hf_qsa_cache import QSAPagedCache, padding
from hf_qsa_cache.blocks import NULL_BLOCK, BlockTable
from hf_qsa_cache.serving.requests import Request
from hf_qsa_cache.serving.scheduler import Scheduler


# ----------------------------------------------------------------------------- block tables
def _check_table(t: BlockTable, rows: int) -> None:
    host = torch.zeros(t.max_rows, t.max_columns, dtype=torch.int32)
    for r, blocks in enumerate(t.rows):
        host[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    for n in {rows, t.max_rows}:
        assert torch.equal(t.device_table(n, "cpu"), host[:n]), f"{t.name}: device table != host rows"
    for r, blocks in enumerate(t.rows):
        assert 0 <= t.base[r] <= len(blocks) and all(b == NULL_BLOCK for b in blocks[: t.base[r]]), (
            f"{t.name}: row {r} holds a block below its base {t.base[r]}")
    t.check_accounting()  # (rows copied by select_rows share blocks: each is counted once per row listing it)
    held = {b for blocks in t.rows for b in blocks if b != NULL_BLOCK}
    assert not held & set(t.free), f"{t.name}: a block is held and free"
    assert len(held) + len(t.free) + t.idle == t.num_blocks - 1, f"{t.name}: blocks leaked"


def _state(t: BlockTable):
    return [list(r) for r in t.rows], list(t.base), list(t.free), t.device_table(t.max_rows, "cpu").clone()


def _same(a, b) -> bool:
    return a[:3] == b[:3] and torch.equal(a[3], b[3])


@pytest.mark.parametrize("window", [None, 5, 9])
@pytest.mark.parametrize("seed", range(4))
def test_block_table_stays_right_under_random_operations(window, seed):
    rng = random.Random(seed)
    R, bs = 5, 2 if seed % 2 else 3
    t = BlockTable("t", 40 if window else 80, bs, R, 48, window=window)
    lengths = [0] * R
    rows = 0
    for op in range(300):
        kind = rng.choice(["step", "step", "step", "abort", "move", "select", "crop", "grow", "reset"])
        if kind in ("step", "abort") and rows:
            batch = rng.randint(1, rows)
            new = [lengths[b] + (rng.randint(0, 7) if rng.random() < 0.3 else rng.randint(0, 1)) for b in range(batch)]
            if max(new) > t.max_columns * bs:
                continue
            naive = sum(t.blocks_needed(b, n) for b, n in enumerate(new))
            assert t.blocks_needed_rows(new) == naive
            if naive > len(t.free):
                continue
            before = _state(t)
            t.begin_step(batch)
            t.reserve_rows(new)
            # What the room checks count is what reserving takes (with a window: only the window's blocks).
            assert len(before[2]) - len(t.free) == naive, (new, lengths)
            for b, n in enumerate(new):
                assert len(t.rows[b]) >= -(-n // bs)
                first = max(0, n - window + 1) // bs if window else 0
                assert all(x != NULL_BLOCK for x in t.rows[b][first: -(-n // bs)]), f"row {b} not addressable"
            if kind == "abort":
                t.rollback_step()
                assert _same(_state(t), before), "a rolled-back step changed the table"
            else:
                lengths[:batch] = new
                t.commit_step(lengths[:rows])
                if window:
                    for b in range(rows):
                        first = max(0, lengths[b] - window + 1) // bs
                        assert all(x == NULL_BLOCK for x in t.rows[b][:first]), f"row {b}: a block out of the window"
        elif kind == "move":
            n = rng.randint(0, R)
            keep = rng.sample(range(rows), min(rows, rng.randint(0, n)))
            src = keep + [-1] * (n - len(keep))
            rng.shuffle(src)
            snapshot = [(list(t.rows[s]), t.base[s]) if s >= 0 else ([], 0) for s in src]
            t.move_rows(src, rows)
            for i in range(max(rows, n)):
                want = snapshot[i] if i < n else ([], 0)
                assert (t.rows[i], t.base[i]) == want, f"move {src}: row {i}"
            lengths = [lengths[s] if s >= 0 else 0 for s in src] + [0] * (R - n)
            rows = n
        elif kind == "select" and rows:
            src = [rng.randrange(rows) for _ in range(rng.randint(1, R))]
            need = t.blocks_for_select(src, rows, lengths)
            if need > len(t.free):
                continue
            free = len(t.free)
            contents = [[b != NULL_BLOCK for b in t.rows[s]] for s in src]
            full = [list(t.rows[s][: lengths[s] // bs]) for s in src]  # shared: the very blocks
            t.select_rows(src, rows, lengths)
            assert free - len(t.free) == need or (need == 0 and len(t.free) >= free), (src, need)
            assert [[b != NULL_BLOCK for b in t.rows[i]] for i in range(len(src))] == contents
            assert [t.rows[i][: len(f)] for i, f in enumerate(full)] == full
            lengths = [lengths[s] for s in src] + [0] * (R - len(src))
            rows = len(src)
        elif kind == "crop" and rows:
            b = rng.randrange(rows)
            new = rng.randint(0, lengths[b])
            lo = max(0, new - window + 1) if window else 0
            if NULL_BLOCK in t.rows[b][lo // bs: -(-new // bs)]:
                continue  # the cache refuses a crop to positions already freed (`QSAPagedCache.crop`)
            lengths[b] = new
            t.truncate(b, new)
        elif kind == "grow":
            t.grow(t.num_blocks + rng.randint(0, 6), 48 + rng.randint(0, 12) * op // 30)
        elif kind == "reset" and rng.random() < 0.2:
            t.reset()
            lengths, rows = [0] * R, 0
        _check_table(t, max(rows, 1))


def test_moving_a_row_costs_its_live_blocks_not_its_length():
    """A windowed row 100k tokens long holds a few live blocks after a long null prefix: moving it (or
    releasing it) visits those, not the prefix."""
    for length in (1000, 100_000):
        t = BlockTable("conv", 64, 4, 4, 200_000, window=4)
        t.begin_step(2)
        t.reserve_rows([length, 7])
        t.commit_step([length, 7])
        t.device_table(4, "cpu")
        t.work = 0
        t.move_rows([1, 0, -1], 2)  # swap, a fresh row
        t.move_rows([1], 3)  # the long row leaves, the short one moves up
        assert t.work <= 12, (length, t.work)
        _check_table(t, 4)


@pytest.mark.parametrize("window", [None, 5], ids=["plain", "windowed"])
def test_a_row_cannot_reserve_past_its_table(window):
    """A table's own bound (the cache's capacity checks refuse first, so nothing else reaches it): a row that would
    need one block more than its table's columns is refused with a ValueError naming both, and nothing changes."""
    t = BlockTable("t", 40, 4, 2, 32, window=window)  # 8 columns of 4 tokens
    t.reserve(0, 32)
    before = _state(t)
    with pytest.raises(ValueError, match=r"row 0 needs 9 blocks, the table holds 8"):
        t.reserve(0, 33)
    assert _same(_state(t), before)


def test_device_tables_land_every_tables_changes_with_one_copy(monkeypatch):
    """Three tables (one plain, two windowed, as Inkling's main, sliding and conv) through steps and row moves:
    each step's `device_tables` equal the host rows and built one host tensor of changes for all the tables that
    changed (one host-to-device copy a step, not one a table)."""
    from hf_qsa_cache import blocks

    rng = random.Random(0)
    tables = {"main": BlockTable("main", 80, 2, 4, 64), "sliding": BlockTable("sliding", 80, 3, 4, 64, window=5),
              "conv": BlockTable("conv", 80, 4, 4, 64, window=4)}
    blocks.device_tables(tables, 4, "cpu")  # (each table on the device: later calls land changes only)
    built = []
    real = blocks.int_tensor
    monkeypatch.setattr(blocks, "int_tensor", lambda values, *args: built.append(values) or real(values, *args))
    lengths, merged = [0] * 4, 0
    for step in range(40):
        lengths = [n + rng.randint(0, 3) for n in lengths]
        for t in tables.values():
            t.begin_step(4)
            t.reserve_rows(lengths)
            t.commit_step(lengths)
        if step % 7 == 6:  # a row finishes, the others move up, a new one takes the last row
            for t in tables.values():
                t.move_rows([1, 2, 3, -1], 4)
            lengths = lengths[1:] + [0]
        built.clear()
        merged += sum(bool(t._changed) for t in tables.values()) > 1
        views = blocks.device_tables(tables, 4, "cpu")
        assert len(built) <= 1, f"step {step}: {len(built)} host tensors of changes"
        for name, t in tables.items():
            host = torch.zeros(t.max_rows, t.max_columns, dtype=torch.int32)
            for r, row in enumerate(t.rows):
                host[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
            assert torch.equal(views[name], host), f"step {step}: {name}'s device table != its rows"
    assert merged >= 20, merged  # (most steps changed several tables: the one copy carried them all)


# ----------------------------------------------------------------------------- one host read of the mask
class DeviceMask(torch.Tensor):
    """A mask that counts its reads to the host, as if it lived on an accelerator: what is computed from it
    alone stays one (mixed with other tensors, e.g. token ids gathered by a mask-derived order, it does not:
    reads of those are reads of the ids). Host reads: ``.cpu()``, ``.to("cpu")`` (a host copy by name; each
    returns a plain tensor), and ``bool`` / ``item`` / ``tolist`` / ``numpy``. ``x.to(other.device)`` moves
    an index beside the activations (CPU tensors here, beside the mask on an accelerator): not a host read."""

    reads: list[str] = []
    _READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.Tensor.cpu or (func is torch.Tensor.to and any(
            isinstance(a, str) and torch.device(a).type == "cpu" for a in [*args[1:], kwargs.get("device")]))
        mixed = any(isinstance(x, torch.Tensor) and not isinstance(x, cls) for x in tree_flatten((args, kwargs))[0])
        if to_host or func in cls._READS or mixed:
            if not mixed:
                cls.reads.append(func.__name__)
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
                if to_host:
                    out = out.clone()  # a host copy, as from an accelerator (a CPU tensor's .cpu() is itself)
            return tree_map(lambda x: x.as_subclass(torch.Tensor) if isinstance(x, torch.Tensor) else x, out)
        return super().__torch_function__(func, types, args, kwargs)


def _models():
    return {"qwen4_exp": qwen_pair(seed=1)[1], "inkling": inkling.make_pair(inkling.make_config(), seed=2)[1]}


@pytest.fixture(scope="module")
def models():
    return _models()


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
@pytest.mark.parametrize("layout", ["left", "right"])
def test_an_eager_masked_step_reads_its_mask_to_the_host_once(models, family, layout):
    model = models[family]
    ids = torch.randint(2, 60, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 7, dtype=torch.long)
    if layout == "left":
        mask[0, :3] = 0
    else:
        mask[0, 4:] = 0
        mask[2, 1] = 0  # a pad between real tokens
    cache = QSAPagedCache(model.config, 3, 32)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, past_key_values=QSAPagedCache(model.config, 3, 32)).logits
        DeviceMask.reads = []
        logits = model(ids, attention_mask=mask.as_subclass(DeviceMask), past_key_values=cache).logits
    assert len(DeviceMask.reads) == 1, DeviceMask.reads
    torch.testing.assert_close(logits.as_subclass(torch.Tensor), plain)
    assert cache.lengths[:3] == mask.sum(1).tolist()


def test_a_mask_changed_in_place_is_read_again():
    mask = torch.ones(2, 4, dtype=torch.long).as_subclass(DeviceMask)
    DeviceMask.reads = []
    first = padding.host_step_columns(mask, 4)
    assert padding.host_step_columns(mask, 4) is first and len(DeviceMask.reads) == 1  # unchanged: no second read
    mask[1, 0] = 0
    assert padding.host_step_columns(mask, 4).tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert padding.host_step_columns(mask, 3).tolist() == [[1, 1, 1], [1, 1, 1]]
    other = mask.clone()
    assert padding.host_step_columns(other, 4).tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert len(DeviceMask.reads) == 4  # changed in place, another step length, another tensor: each read


# ----------------------------------------------------------------------------- scheduler
def _request(i: int, prompt: int) -> Request:
    return Request(f"r{i}", [5] * prompt, 10, frozenset())


def _moves(before: list, after: list) -> int:
    """Requests held before and after that changed row."""
    where = {id(r): i for i, r in enumerate(before)}
    return sum(1 for i, r in enumerate(after) if id(r) in where and where[id(r)] != i)


def test_decoding_requests_keep_their_rows():
    scheduler = Scheduler(max_rows=8, max_batch_tokens=64, prefill_first=False)
    requests = [_request(i, 6) for i in range(8)]
    for r in requests:
        scheduler.submit(r)
    scheduler.admit()
    for r in requests[2:]:  # six decode, two still prefill
        r.held, r.generated, r.status = 6, [1], RequestStatus.DECODING
    scheduler.order()
    assert scheduler.rows[:2] == requests[:2]
    placed = list(scheduler.rows)
    scheduler.order()
    assert scheduler.rows == placed  # nothing changed: nothing moves

    done = placed[3]  # a decoding request in the middle finishes
    scheduler.release(done)
    scheduler.order()
    assert done not in scheduler.rows and _moves(placed, scheduler.rows) == 1
    placed = list(scheduler.rows)

    placed[0].held = 6  # the oldest prefilling request starts decoding
    placed[0].generated = [1]
    scheduler.order()
    assert scheduler.rows[0] is placed[1] and scheduler.rows[1] is placed[0]  # it and the one behind it only
    assert _moves(placed, scheduler.rows) == 2
    placed = list(scheduler.rows)

    late = _request(9, 6)  # a new request takes a row: prefilling rows stay first, one decoding row makes room
    scheduler.submit(late)
    scheduler.admit()
    assert scheduler.rows[:2] == [placed[0], late] and _moves(placed, scheduler.rows) == 1
    assert scheduler.prefilling() == 2
    assert sorted(map(id, scheduler.rows)) == sorted(map(id, [*placed, late]))


@pytest.mark.parametrize("window", [None, 2, 3, 6, 7, 13], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("block_size", [1, 3, 4], ids=lambda b: f"block{b}")
def test_longest_row_is_how_far_a_row_alone_grows_on_the_pool(window, block_size):
    """`BlockTable.longest_row`: a row that has the pool to itself, fed one position a step (each step landing
    frees the blocks that left its window), reaches exactly that length, or never runs out (None)."""
    for num_blocks in range(2, 12):
        grown = BlockTable("t", num_blocks, block_size, max_rows=1, max_len=400, window=window)
        n = 0
        while n < 399 and grown.blocks_needed(0, n + 1) <= len(grown.free):
            grown.begin_step(1)
            grown.reserve(0, n + 1)
            grown.commit_step([n + 1])
            n += 1
        want = None if n == 399 else n
        assert BlockTable("t", num_blocks, block_size, 1, 400, window).longest_row() == want, num_blocks
