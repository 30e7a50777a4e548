"""Which requests hold cache rows, in what order, what each step feeds, and whom to preempt (host only).

The cache's steps cover a prefix of its rows, so rows are kept in one order: requests still prefilling
first (rows ``[0, p)``), then those decoding. Two kinds of step follow (with ``grouped_steps=True`` the
manager runs both in one *grouped step* instead, unless a row's prompt tokens come from a media encoding: the
prefill chunks of ``prefill_chunks(packed=True)``, no pads, the rows sharing the budget, beside the decoding
rows' tokens, `ModelRunner.grouped`):

* a prefill step feeds the oldest prefilling requests a chunk of their pending tokens (rows ``[0, k)``:
  the oldest takes as much of ``max_batch_tokens`` as it can use, the next ones join while ``k`` chunks of
  that length fit and pads stay at most half the step (the next row's longer chunk sets the length instead
  where that feeds more tokens); a chunk may end anywhere: inside a QSA group, a
  window, a conv span, except that with prefix caching a chunk ends at the request's snapshot point, the last
  unit boundary before its last token, when it passes it and more than ``snapshot_gap`` of its tokens come after
  the prefix its row starts from or stops at (`plan_prefix_stop`): the runner caches the prefix there). With prefix
  caching, a request whose prefix an older one is computing (the same stop, the same tokens) waits for it and
  then restores it; waiting rows are ordered after the other prefilling rows, so they do not end a step
  before the rows behind them;
* a decode step feeds every row one token: a decoding request its last sampled token, a prefilling one
  its next prompt token (useful work, and one real token per row: the CUDA-graph decode step applies).

An iteration runs one step of each kind, the decode step first (``prefill_first``: the prefill step), unless the
prefill step replays a recorded graph and ends a row's prompt or leaves it one short step from its end
(`prefill_goes_first`; that short step then follows before the decode step).

Admission is first come, first served while rows are free and the block pools hold the next request's
first step beside the running rows' next tokens (an *isolated* request, one the manager suspects of a fault,
runs alone: `Request.alone_until`); when the pools cannot hold a step about to run (each step is checked with
exactly the tokens it feeds), the request admitted last is preempted (its row and blocks released; its tokens so
far are fed again when it is readmitted, so it loses no token and gains no wrong one).
"""

from __future__ import annotations

from collections import deque

from ..prefix_cache import snapshot_point
from .requests import Request, RequestStatus


class Scheduler:
    def __init__(self, max_rows: int, max_batch_tokens: int, prefill_first: bool, unit: int | None = None,
                 replays=None, snapshot_gap: int = 0):
        self.max_rows = max_rows
        # replays(rows, length): whether a prefill step of the first rows, length tokens the longest, replays a
        # recorded graph (`ModelRunner.replays_prefill`; None: never, as on a CPU).
        self.replays = replays or (lambda rows, length: False)
        self.unit = unit  # prefix caching: chunks stop at each request's snapshot point (`plan_prefix_stop`)
        # ... unless at most this many of its tokens come after its row's cached prefix (`PrefixCache.snapshot_gap`)
        self.snapshot_gap = snapshot_gap
        self.max_batch_tokens = max_batch_tokens
        self.prefill_first = prefill_first
        self.waiting: deque[Request] = deque()
        self.rows: list[Request] = []  # the row order the cache must have (the runner makes it so)
        self._slot: dict[Request, int] = {}  # each request's row at the last `order`
        self._ordered: tuple[list[Request], int] | None = None  # (rows as `order` left them, how many prefill)
        self._admissions = 0
        # Prefix caching: the requests in flight or waiting by `Request.prompt_head` (prompts of a unit or more), so
        # that placing a request finds those sharing its first unit without a pass over the queue. Only `submit`
        # and `release` change who is in flight or waiting (admission and preemption move requests between the two).
        self._by_head: dict[int, list[Request]] = {}

    def submit(self, request: Request) -> None:
        self.waiting.append(request)
        head = request.prompt_head(self.unit) if self.unit else None
        if head is not None:
            self._by_head.setdefault(head, []).append(request)

    def plan_prefix_stop(self, request: Request, matched: int) -> None:
        """Where ``request``'s prefill stops to cache its state, now that cached blocks match ``matched`` of its
        tokens (its row placed, restored from ``request.prefix_hit`` tokens, or looking again mid-prefill): its stop
        (`Request.prefix_stop`), the further of the blocks' end and the longest whole-unit prefix it shares with
        another request in flight or waiting (computed once by the first of them, restored by the others), nowhere
        if neither passes what its row holds; and its snapshot point (`_stop_at`).

        A peer in flight that has not fed the shared part yet, with no stop of its own ahead, stops there too: it
        caches its state at that point and ``request`` restores it (`_prefill_order` has the later of two rows with
        the same stop wait for the older) instead of computing the prefix again."""
        shared, peer = self.shared_with_peers(request)
        stop = max(matched, shared)
        self._stop_at(request, stop if stop > request.held else 0)
        if (peer is not None and stop == shared > request.held and peer.held < shared
                and peer.prefix_stop <= peer.held and any(r is peer for r in self.rows)):
            self._stop_at(peer, shared)

    def _stop_at(self, request: Request, stop: int) -> None:
        """The request's stop (0: none), and its snapshot point (`Request.snapshot_at`): the last unit boundary
        before its last token, if more than ``snapshot_gap`` of its tokens come after both the stop and the prefix
        its row was restored from (`hf_qsa_cache.prefix_cache.snapshot_point`), else none."""
        request.stop_prefix_at(stop)
        start = max(request.prefix_hit, stop)
        point = snapshot_point(start, request.total, self.unit, self.snapshot_gap)
        request.snapshot_at = point if point > start else 0

    def shared_with_peers(self, request: Request) -> tuple[int, Request | None]:
        """``(length, peer)``: the longest whole-unit prefix (before its last token) the request's tokens share with
        another request's prompt in flight or waiting, and the first such request (None if none shares a unit)."""
        unit = self.unit
        limit = (request.total - 1) // unit * unit
        if limit < unit:
            return 0, None
        tokens = request.first_tokens(limit)
        head, best, peer = tokens[:unit], 0, None
        key = request.prompt_head(unit)  # (its prompt's, made once; a prompt shorter than a unit: its tokens' head)
        for other in self.sharing_head(hash(tuple(head)) if key is None else key):  # (not a pass over the queue)
            theirs = other.prompt
            if other is request or other.media is not None or len(theirs) < best + unit or theirs[:unit] != head:
                continue
            # Unit by unit from the first: a prompt's units are compared once each (a bisection over whole
            # prefixes copied and compared ~2 log2(n) prefixes of up to n tokens: 3 ms a restore at 10,240).
            end, stop = unit, min(limit, len(theirs) // unit * unit)
            while end < stop and tokens[end: end + unit] == theirs[end: end + unit]:
                end += unit
            if end > best:
                best, peer = end, other
        return best, peer

    def sharing_head(self, head: int) -> list[Request]:
        """The requests in flight or waiting whose prompt's first unit hashes to ``head`` (`Request.prompt_head`;
        a hash: the caller compares the tokens)."""
        return self._by_head.get(head, [])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.rows)

    def admit(self, fits=None) -> list[Request]:
        """Waiting requests (oldest first) take the free rows; returns them. ``fits(request, admitted)`` (None:
        always) says whether the block pools hold ``request``'s first step beside the rows and the requests
        ``admitted`` so far: admission stops at the first that does not (first come, first served), unless no
        row is taken (alone, a request always gets its row: it then finishes or fails as "cannot fit alone")."""
        admitted = []
        while self.waiting and len(self.rows) < self.max_rows:
            request = self.waiting[0]
            if self.runs_isolated() or (request.alone_until and self.rows):
                break  # an isolated request runs alone: it waits for the rows to go, then nothing joins it
            if fits is not None and self.rows and not fits(request, admitted):
                break
            self.waiting.popleft()
            request.admitted = self._admissions
            self._admissions += 1
            if request.status == RequestStatus.PENDING:
                request.status = RequestStatus.PREFILLING
            self.rows.append(request)
            admitted.append(request)
        if admitted:
            self._ordered = None
        self.order()
        return admitted

    def first_chunk(self, request: Request) -> int:
        """Tokens a newly admitted request feeds in its first step (at most the prefill budget)."""
        return min(request.pending, self.max_batch_tokens)

    def order(self) -> None:
        """Prefilling rows first, oldest admitted first but for those waiting for an older row's prefix
        (`_prefill_order`; a prefill step takes a prefix of the rows), then the decoding ones. A decoding request
        keeps the row it had at the last `order` while that row is still a decoding row; the others take the
        free ones, in their current order. So a request that finishes or starts decoding moves at most one
        decoding request, not every one after it (the cache rewrites the block-table rows of the requests that
        change row: `QSAPagedCache.move_rows`).

        When no request came or left since the last `order`, every prefilling request still is (a decoding one
        never becomes one again but by preemption) and none started or stopped waiting, nothing moves: only the
        prefilling rows are looked at."""
        rows = self.rows
        if self._ordered is not None and self._ordered[0] is rows \
                and all(r.in_prefill for r in rows[: self._ordered[1]]) \
                and all(a is b for a, b in zip(self._prefill_order(rows[: self._ordered[1]]), rows)):
            return
        prefilling = [r.in_prefill for r in rows]
        layout = self._prefill_order([r for r, p in zip(rows, prefilling) if p])
        first, n = len(layout), len(rows)
        layout += [None] * (n - first)
        slot, moving = self._slot, []
        for request, p in zip(rows, prefilling):
            if not p:
                i = slot.get(request, -1)
                if first <= i < n and layout[i] is None:
                    layout[i] = request
                else:
                    moving.append(request)
        if moving:
            free = [i for i in range(first, n) if layout[i] is None]
            for i, request in zip(free, moving):
                layout[i] = request
        self.rows = layout
        self._slot = {request: i for i, request in enumerate(layout)}
        self._ordered = (layout, first)

    @staticmethod
    def _prefill_order(prefilling: list[Request]) -> list[Request]:
        """Prefilling requests oldest admitted first, except those waiting for an older one's stop (`_stop`),
        which go after the others: a prefill step takes a prefix of the rows, and a waiting row would end it
        before the rows behind it (requests of other shared prefixes, which can run now)."""
        ready, waiting, computing = [], [], set()
        for request in sorted(prefilling, key=lambda r: r.admitted):
            stop = _stop(request)
            if stop is not None and stop in computing:
                waiting.append(request)
                continue
            if stop is not None:
                computing.add(stop)
            ready.append(request)
        return ready + waiting

    def release(self, request: Request) -> None:
        """The request leaves its row (finished, failed, cancelled) or the queue."""
        if request in self.rows:
            self.rows.remove(request)
            self._ordered = None
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            return
        head = request.prompt_head(self.unit) if self.unit else None
        if head is not None:
            sharing = self._by_head[head]
            sharing.remove(request)
            if not sharing:
                del self._by_head[head]

    def preempt(self, request: Request) -> None:
        """Back to the front of the queue (behind the isolated requests), without a row: its tokens so far are fed
        again when readmitted."""
        self.rows.remove(request)
        self._ordered = None
        request.held = 0
        request.status = RequestStatus.PENDING
        self.waiting.appendleft(request)
        if not request.alone_until and any(r.alone_until for r in self.waiting):
            self.waiting = deque(sorted(self.waiting, key=lambda r: not r.alone_until))  # (a stable sort)

    def runs_isolated(self) -> bool:
        """Whether an isolated request holds a row (it is then the only one: `admit`)."""
        return any(r.alone_until for r in self.rows)

    def isolated_waits(self) -> bool:
        """Whether an isolated request waits for the rows while others hold them (the manager preempts them)."""
        return bool(self.waiting and self.waiting[0].alone_until and self.rows and not self.runs_isolated())

    def victim(self) -> Request | None:
        """Whom to preempt when the pools cannot hold the next step: the latest admitted (None if alone)."""
        if len(self.rows) < 2:
            return None
        return max(self.rows, key=lambda r: r.admitted)

    def prefilling(self) -> int:
        """Requests still prefilling: they hold rows ``[0, p)`` (`order` puts them first), so counting stops at
        the first decoding row."""
        p = 0
        for request in self.rows:
            if not request.in_prefill:
                break
            p += 1
        return p

    def _to_snapshot(self, request: Request, chunk: int) -> int:
        """``chunk`` cut so that it ends at the request's next stop: the end of what others cached as blocks
        without a snapshot there (`Request.prefix_stop`), or its snapshot point (`Request.snapshot_at`), if it would
        pass it."""
        for point in (request.prefix_stop, request.snapshot_at):
            if request.held < point < request.held + chunk:
                return point - request.held
        return chunk

    def prefill_chunks(self, packed: bool = False) -> list[int]:
        """Tokens the first ``k`` prefilling rows get in a prefill step (rows ``[0, k)``, oldest first).

        The oldest prefilling request takes as much of the budget as it can use (its first token comes
        soonest, first come first served). The step's length is its chunk, and the rows after it join while
        ``k * length`` fits the budget and pads (a row with less than that length is padded) stay at most half
        of the step; except that when the oldest chunk is short (a prompt's last tokens after its snapshot
        point, say) and the next row can use more, the step takes that row's length if it feeds more tokens so:
        the short chunk rides along, padded, instead of setting a short step of its own (an eager step costs its
        host work, whatever its size). But where a step of the first rows replays a recorded graph (``replays``: a
        fraction of that host work), the step is those rows: as many as replay (a power of two: a step of three rows
        that would run eagerly takes two, the third waits for the next step), the short chunk with the rows that
        join it at its length (riding along would cost the pads' GPU work). ``packed`` (a grouped step: no pads), the
        rows after it take what is left of the budget, each as much as it can use."""
        p = self.prefilling()
        if p == 0:
            return []
        first = self._to_snapshot(self.rows[0], min(self.rows[0].pending, self.max_batch_tokens))
        chunks = self._joined(first, first, p, packed)
        if packed or p < 2:
            return chunks
        replaying = self._replaying_rows(chunks)
        if replaying:
            return chunks[:replaying]
        longer = self._to_snapshot(self.rows[1], min(self.rows[1].pending, self.max_batch_tokens // 2))
        if longer > first:
            wider = self._joined(first, longer, p, packed=False)
            if sum(wider) > sum(chunks):
                return wider
        return chunks

    def prefill_goes_first(self, then_ends: bool = True) -> bool:
        """Whether an iteration runs its prefill step before its decode step: always with ``prefill_first``; else
        when that step replays a recorded graph and ends a row's prompt (its chunk is all the row has pending: the
        last tokens of a prompt stopped at its snapshot point or at a shared prefix, a short prompt), or, with
        ``then_ends``, leaves a row one short step from its end (one token, which the decode step feeds, or a rest
        whose own step replays: a prompt's tail after its snapshot point), which then follows at once
        (`ContinuousBatchingManager._iteration` asks again with ``then_ends=False``). The request's first token then
        comes without a decode step of every row before or between its last prefill steps; the decoding rows wait
        those replays."""
        if self.prefill_first:
            return True
        chunks = self.prefill_chunks()
        if not chunks or not self.replays(len(chunks), max(chunks)):
            return False
        for chunk, request in zip(chunks, self.rows):
            rest = request.pending - chunk
            if rest == 0 or (then_ends and self._one_short_step(request, chunk)):
                return True
        return False

    def _one_short_step(self, request: Request, chunk: int) -> bool:
        """Whether what ``request`` has pending after ``chunk`` takes one more step: one token (the decode step feeds
        it), or one chunk (no stop inside it, within the budget) whose own step replays a recorded graph."""
        start, rest = request.held + chunk, request.pending - chunk
        if rest == 1:
            return True
        stops = (request.prefix_stop, request.snapshot_at)
        return (0 < rest <= self.max_batch_tokens and not any(start < point < start + rest for point in stops)
                and self.replays(1, rest))

    def _replaying_rows(self, chunks: list[int]) -> int:
        """The most of the step's first rows (a power of two of them) whose step of their ``chunks`` replays a
        recorded graph (``replays``), or 0 if none does. A replay costs a fraction of an eager step's host work, so
        rows that would make the step eager wait for the next one instead."""
        k = 1 << (len(chunks).bit_length() - 1)
        while k and not self.replays(k, max(chunks[:k])):
            k //= 2
        return k

    def _joined(self, first: int, length: int, p: int, packed: bool) -> list[int]:
        """The oldest prefilling row's ``first`` tokens, then the rows after it as they join a step of ``length``
        columns (``packed``: the budget left) in order, until one does not."""
        chunks = [first]
        computing = {_stop(self.rows[0])}
        for r in self.rows[1:p]:
            left = self.max_batch_tokens - sum(chunks)
            if left < 1 or (not packed and (len(chunks) + 1) * length > self.max_batch_tokens):
                break
            stop = _stop(r)
            if stop is not None and stop in computing:
                break  # an older row is computing the same cached-blocks prefix: start from its snapshot instead
            computing.add(stop)
            if packed:  # no pads (a grouped step): the rows share the budget, each taking what it can use
                chunks.append(self._to_snapshot(r, min(r.pending, left)))
                continue
            chunk = self._to_snapshot(r, min(r.pending, length))
            # Every row of the step is padded to `length`: a row joins only while pads stay at most half the step.
            if (len(chunks) + 1) * length > 2 * (sum(chunks) + chunk):
                break
            chunks.append(chunk)
        return chunks


def _stop(request: Request) -> tuple[int, int] | None:
    """The prefix the request's prefill is computing towards to cache it for others (its stop and the key of its
    tokens, `Request.stop_prefix_at`), or None: requests with the same one share it."""
    if 0 < request.prefix_stop and request.held < request.prefix_stop:
        return request.prefix_stop, request.prefix_key
    return None
