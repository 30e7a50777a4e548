"""`Rows`: the host-side state of a cache's rows, and the one place that writes it.

A row is one sequence of a batch (a beam, a continuous-batching request). Per row the cache keeps:

* ``lengths``: its logical length (real tokens; pads excluded);
* ``rope_deltas``: its multimodal RoPE offset (Qwen4Exp with images or video): a token given no explicit
  position ids is rotated at its logical position plus this delta, so text after an image continues
  where the image's 3-D positions end. Zero for text-only rows;
* ``crop_floor``: the shortest length a crop may reach (Qwen4Exp's rollback rings; `hf_qsa_cache.rollback`).

and for the batch: ``count`` (rows in flight), ``columns`` (the rectangular length, pads included, that
`generate()` reasons in) and ``managed`` (rows placed one by one by continuous batching rather than a batch
`generate()` holds).

Every per-row field is named in `PER_ROW`: selecting, moving, releasing, snapshotting and restoring rows
treat them all alike, so a new field is one entry there. The device data of a row (paged blocks, per-row
tensors) is owned by the block tables and the stores; this object never touches it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowsSnapshot:
    fields: dict[str, list[int]]
    count: int
    columns: int
    managed: bool


class Rows:
    PER_ROW = ("lengths", "rope_deltas", "crop_floor")

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.reset()

    def reset(self) -> None:
        """Every row released: no row in flight, nothing held."""
        for name in self.PER_ROW:
            setattr(self, name, [0] * self.max_rows)
        self.count = 0
        self.columns = 0
        self.managed = False

    # ------------------------------------------------------------------ transactions
    def snapshot(self) -> RowsSnapshot:
        return RowsSnapshot({name: list(getattr(self, name)) for name in self.PER_ROW}, self.count, self.columns,
                            self.managed)

    def restore(self, snapshot: RowsSnapshot) -> None:
        for name, values in snapshot.fields.items():
            setattr(self, name, list(values))
        self.count, self.columns, self.managed = snapshot.count, snapshot.columns, snapshot.managed

    # ------------------------------------------------------------------ a step
    def advance(self, new_lengths: list[int], query_len: int, rope_deltas: list[int | None] | None = None) -> None:
        """Rows ``[0, len(new_lengths))`` took a step of ``query_len`` columns and now hold ``new_lengths``
        tokens; ``rope_deltas`` gives a row's new offset (None keeps it)."""
        rows = len(new_lengths)
        self.lengths[:rows] = new_lengths
        self.count = max(self.count, rows) if self.managed else rows
        self.columns += query_len
        for b, delta in enumerate(rope_deltas or []):
            if delta is not None:
                self.rope_deltas[b] = int(delta)

    def shorten(self, drop: int) -> None:
        """Every row in flight drops its last ``drop`` tokens (and the batch as many columns)."""
        for b in range(self.count):
            self.lengths[b] -= drop
        self.columns -= drop

    def raise_crop_floor(self, row: int, floor: int) -> None:
        """Row ``row`` may no longer be cropped below ``floor`` (floors only rise until the row is released)."""
        self.crop_floor[row] = max(self.crop_floor[row], floor)

    def next_positions(self, rows: int) -> list[int]:
        """The RoPE position each of the first ``rows`` rows continues at (its length plus its delta)."""
        return [self.lengths[b] + self.rope_deltas[b] for b in range(rows)]

    # ------------------------------------------------------------------ placing rows
    def select(self, src: list[int]) -> None:
        """Row ``i`` becomes a copy of row ``src[i]``; rows past ``len(src)`` are released (beam search)."""
        self._permute(src)

    def move(self, src: list[int]) -> None:
        """Row ``i`` becomes row ``src[i]``, or a fresh row where ``src[i] == -1``; rows no entry names are
        released. The rows are managed from now on (continuous batching)."""
        self._permute(src)
        self.managed = True
        self.columns = max(self.columns, 1)  # generate()'s whole-batch rules no longer apply

    def _permute(self, src: list[int]) -> None:
        pad = [0] * (self.max_rows - len(src))
        for name in self.PER_ROW:
            values = getattr(self, name)
            setattr(self, name, [values[s] if s >= 0 else 0 for s in src] + pad)
        self.count = len(src)

    def __repr__(self):
        return f"Rows(count={self.count}, columns={self.columns}, lengths={self.lengths[:self.count]})"
