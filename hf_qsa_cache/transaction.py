"""One forward as a transaction on a `QSAPagedCache`: what a step may change, and how it is taken back.

A step changes five kinds of state; each has one way back, decided here and nowhere else:

* host bookkeeping (row lengths and RoPE deltas, rows in flight, columns seen, crop floors): a copy taken before
  anything changes, put back whole;
* block tables: each table journals the blocks the step reserves (`BlockTable.begin_step`), and blocks
  that fall out of a window are only released at commit, so an abort finds every block where it was;
* paged stores (attention K/V, QSA compressed keys, Inkling conv taps) and the token log: a step
  writes them only at positions past its rows' old lengths, which nothing reads once the lengths are
  back;
* stores overwritten in place (GatedDeltaNet / PLE state and windows, the QSA raw-key ring): the step's
  rows are copied aside before the first write (one batched copy) and copied back on abort;
* the speculative rollback rings (Qwen4Exp): not copied. An aborted step may have overwritten entries
  a crop would read, so after an abort a row cannot be cropped to its current length or below (a crop
  of rejected drafts after a retried verify step never goes there: the verified token stays).

A cache that held nothing before the step is reset instead (exact and cheaper). If taking the step back
fails itself, the cache refuses every further step with an error that names ``reset()``; the original
error is what the caller sees.
"""

from __future__ import annotations


class StepTransaction:
    """Opened before a step changes anything; ends with exactly one of `commit` or `abort`."""

    def __init__(self, cache, batch_size: int):
        self.cache = cache
        self.batch_size = batch_size
        self.host = (list(cache.lengths), list(cache.rope_deltas), cache.num_rows, cache.columns_seen,
                     list(cache._crop_floor))
        # Managed rows (continuous batching) are never reset wholesale: the other rows hold live requests.
        self.started_empty = cache.columns_seen == 0 and not cache.rows_managed
        self.saved_rows = 0  # rows of in-place state copied aside (0: nothing to copy back)
        for table in cache.tables.values():
            table.begin_step(batch_size)

    def save_rows(self) -> None:
        """Copy the step's rows of every in-place state aside (before any layer writes)."""
        self.cache.copy_rows_aside(self.batch_size)
        self.mark_saved(self.batch_size)

    def mark_saved(self, rows: int) -> None:
        """``rows`` rows of in-place state were copied aside: an abort copies them back."""
        if not self.started_empty:  # an abort resets the cache: nothing to copy back
            self.saved_rows = rows

    def commit(self) -> None:
        """The step landed: release blocks that fell out of the windows."""
        cache = self.cache
        for table in cache.tables.values():
            table.commit_step(cache.lengths[: cache.num_rows])

    def abort(self) -> None:
        """Put the cache back as it was before the step (see the module docstring)."""
        cache = self.cache
        lengths, deltas, cache.num_rows, cache.columns_seen, cache._crop_floor = self.host
        cache.lengths, cache.rope_deltas = lengths, deltas
        for table in cache.tables.values():
            table.rollback_step()
        cache.clear_step_metadata()
        try:
            if self.started_empty:
                cache.reset()
                return
            if self.saved_rows:
                cache.copy_rows_back(self.saved_rows)
        except BaseException as error:  # the original error is the one the caller sees
            cache.mark_unusable(f"a forward failed and taking it back failed too ({type(error).__name__}: {error})")
            return
        if cache.keeps_rollback_history:
            # The step may have overwritten ring entries a crop would read: no crop to the current length or below.
            for b in range(cache.num_rows):
                cache._crop_floor[b] = max(cache._crop_floor[b], cache.lengths[b] + 1)
