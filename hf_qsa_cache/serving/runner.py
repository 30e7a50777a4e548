"""The model and its cache in the continuous-batching loop: keeps the cache's rows in the scheduler's
order, runs each step's forward, samples the next tokens."""

from __future__ import annotations

import logging

import torch

from .. import cuda_graphs
from ..cache import QSAPagedCache
from ..cuda_graphs import decode_graphs_for, recorded_steps
from ..grouped import grouped_logits
from ..ops import int_tensor
from ..rollback import crop_rows
from .requests import Request
from .sampling import PenaltyTables, draw, token_uniform, warp_rows

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, cache: QSAPagedCache, return_logprobs: bool = False):
        self.model = model
        self.cache = cache
        self.return_logprobs = return_logprobs
        self.device = next(model.parameters()).device
        self.rows: list[Request] = []  # the cache's rows, in order
        self.plain_rows = True  # every row greedy, unpenalized, without logprobs: a step's sampling is one argmax
        # A multimodal prompt's encoding (`model.encode_prompt`: its embeddings, positions), by request, kept
        # until the request ends (a preempted request feeds its prompt again). Keyed by the request itself (it
        # hashes by identity), never by id(): an ended request's id can be a new request's.
        self.encoded: dict[Request, dict] = {}
        # Prefix caching: each decoding request's snapshot at the last unit boundary its row reached (the state a
        # finished request's prefix is cached with), kept while the request holds its row.
        self.tails: dict[Request, object] = {}
        # Prefix caching: where a restored request's prefill stops to cache a prefix, given how far cached blocks
        # match its tokens (the manager sets it: `Scheduler.plan_prefix_stop`, which knows the requests sharing them).
        self.plan_prefix_stop = None
        # Whether a recorded step ran since the loop (re)started (`start_session`), checking the model then. No user
        # code runs between the loop's steps, so the eager steps after it need not make the next recorded step walk
        # every weight to see whether the model changed (`DecodeGraphs.steps_were_own`); before it user code may have.
        self.graphs_checked = False
        # The penalized requests' token histories (made at the first penalized request), a slot while it holds a row.
        self.penalties: PenaltyTables | None = None

    def start_session(self) -> None:
        self.graphs_checked = False

    def encode(self, request: Request) -> None:
        if request.media is not None and request not in self.encoded:
            ids = torch.tensor([request.prompt], dtype=torch.long, device=self.device)
            media = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in request.media.items()}
            self.encoded[request] = self.model.encode_prompt(ids, media)

    def forget(self, request: Request) -> None:
        self.encoded.pop(request, None)

    def place(self, order: list[Request]) -> None:
        """Make the cache's rows ``order``: rows of requests that left are released, new requests get fresh
        rows (`QSAPagedCache.move_rows`: blocks change owner, nothing is recomputed)."""
        if order == self.rows:  # requests compare by identity
            return
        index = {r: i for i, r in enumerate(self.rows)}
        src = [index.get(r, -1) for r in order]
        if self.penalties is not None:  # requests that leave their rows give their slots back
            for request in set(self.rows).difference(order):
                self.penalties.release(request)
        if order:
            self.cache.move_rows(src)
        else:
            self.cache.reset()  # no request holds a row (cached prefixes stay)
        self.rows = list(order)
        self.plain_rows = all(r.sampling.plain_greedy and not r.want_logprobs for r in order)  # (as rows change)
        for row, (request, s) in enumerate(zip(order, src)):
            if s == -1:
                request.held = 0
                request.prefix_seen = -1
                self.tails.pop(request, None)
                if self.cache.prefix is not None and request.media is None:
                    self._restore(row, request)
        if self.tails:
            placed = set(order)
            self.tails = {r: s for r, s in self.tails.items() if r in placed}

    def release_all(self) -> None:
        """Every row back (the loop ended): the cache is reset, whatever state a failure left it in."""
        self.cache.reset()
        self.rows = []
        self.plain_rows = True
        self.tails.clear()
        self.penalties = None

    def _restore(self, row: int, request: Request) -> None:
        """Start the request's empty row from the longest cached prefix of its tokens; where cached blocks reach
        further than any snapshot, or another request shares more of its tokens, its prefill will stop there once
        to cache its state (`Request.prefix_stop`, planned by `Scheduler.plan_prefix_stop`)."""
        cache = self.cache
        first = request.prefix_seen == -1  # (a row's first look is a lookup; later ones, hits beyond its earlier)
        request.prefix_seen = cache.prefix.version
        request.held = cache.restore_prefix(row, request.first_tokens(request.total), limit=request.total - 1,
                                            counted=None if first else request.prefix_hit)
        request.prefix_hit = request.held if first else max(request.prefix_hit, request.held)
        self.plan_prefix_stop(request, cache.prefix_matched)

    def retry_restores(self) -> bool:
        """Rows that have fed nothing yet, or that are prefilling towards a prefix others cached as blocks, look
        again if prefixes were cached since their last look (requests admitted together prefill one after the
        other: the later ones start from what the earlier cached). A row that a longer cached prefix now serves
        gives back what it fed and starts from that prefix. Returns whether a row was restored (the scheduler
        orders the rows again)."""
        cache = self.cache
        if cache.prefix is None:
            return False
        version, again = cache.prefix.version, []
        for row, request in enumerate(self.rows):
            if request.prefix_seen == version or request.total < 2 or request.media is not None:
                continue
            if request.held == 0:
                again.append((row, request))
            elif request.in_prefill:
                request.prefix_seen = version
                restorable, matched = cache.prefix_lookup(request.first_tokens(request.total), limit=request.total - 1)
                if restorable > request.held:
                    again.append((row, request))
                elif matched > max(request.held, request.prefix_stop):
                    self.plan_prefix_stop(request, matched)  # it stops there to cache its state for others
            else:  # decoding: it never looks again (a preempted request gets a fresh row, which does)
                request.prefix_seen = version
        if not again:
            return False
        fed = [row for row, request in again if request.held]
        if fed:  # those rows start over, empty (their blocks go back; no other row moves)
            cache.move_rows([-1 if i in fed else i for i in range(len(self.rows))])
            for row, request in again:
                request.held = 0
        for row, request in again:
            self._restore(row, request)
        return any(request.held for _, request in again)

    def _after_step(self, rows: list[Request], counts: list[int] | None = None) -> None:
        """Prefix caching, after a step landed (before its tokens are sampled): a row that reached its snapshot
        point (the scheduler stopped its prefill there) is cached as a prefix; a row at any other unit boundary
        keeps a snapshot for when it finishes (`retire`). ``counts``: the tokens each row took (a row that took
        none is left as it was)."""
        unit = self.cache.prefix.unit
        for row, request in enumerate(rows):
            held = request.held
            if held == 0 or held % unit or request.media is not None or (counts is not None and not counts[row]):
                continue  # (a prompt with media: its tokens do not say what its state holds)
            try:
                if held == request.snapshot_at or held == request.prefix_stop:
                    self.cache.cache_prefix(row, request.first_tokens(held))
                else:
                    self.tails[request] = self.cache.snapshot_row(row)
            except Exception as error:  # the step landed: a prefix that cannot be kept is only a later miss
                logger.warning("caching the prefix of request %s failed: %s", request.request_id, error)

    def retire(self, request: Request) -> None:
        """A finished request's row becomes a cached prefix up to the last unit boundary it reached."""
        cache, tail = self.cache, self.tails.pop(request, None)
        if cache.prefix is None or request not in self.rows or request.media is not None:
            return
        row = self.rows.index(request)
        tokens = request.first_tokens(request.held)
        if request.held % cache.prefix.unit == 0:
            cache.cache_prefix(row, tokens)
        elif tail is not None:
            cache.cache_prefix(row, tokens, snapshot=tail)

    def why_not_fits(self, growth: list[int]) -> str | None:
        """None if every row can grow by ``growth`` tokens in the next steps, else what stands in the way."""
        lengths = [min(r.held + g, r.most_held) for r, g in zip(self.rows, growth)]
        return self.cache.why_not_fits(lengths, what="the next step")

    def prefill(self, chunks: list[int]) -> list[tuple[Request, int, float | None]]:
        """Rows ``[0, len(chunks))`` take their next ``chunks[i]`` tokens (left-padded to one length); returns
        the sampled (request, token, logprob) of rows that have then fed everything they had."""
        rows = self.rows[: len(chunks)]
        length = max(chunks)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for i, (request, n) in enumerate(zip(rows, chunks)):
            ids[i, length - n:] = torch.tensor(request.next_tokens(n))
            mask[i, length - n:] = 1
        logits = self._forward(rows, ids, mask)
        for request, n in zip(rows, chunks):
            request.held += n
        if self.cache.prefix is not None:
            self._after_step(rows)
        return self._sample(rows, logits[:, -1])

    def replays_prefill(self, rows: int, length: int) -> bool:
        """Whether a prefill step of the first ``rows`` rows, ``length`` tokens the longest, would replay a recorded
        graph (`_forward`'s route) rather than run eagerly."""
        return (cuda_graphs.graphs_device(self.model) is not None and not self._feeds_embeddings(self.rows[:rows])
                and cuda_graphs.takes_graph_shape(self.cache, rows, length, logits_to_keep=1))

    def replays_mixed(self, chunks: list[int]) -> bool:
        """Whether the first rows' prefill ``chunks`` and every other row's next token can be one recorded step
        (`mixed`): the chunks' rows are every row still prefilling and would replay a short prefill step, at least
        one row decodes, and the model runs grouped steps."""
        rest = self.rows[len(chunks):]
        return (bool(chunks) and bool(rest) and not any(r.in_prefill for r in rest)
                and hasattr(self.model, "_grouped_logits") and self.replays_prefill(len(chunks), max(chunks)))

    def mixed(self, chunks: list[int]) -> list[tuple[Request, int, float | None]]:
        """One recorded step (`DecodeGraphs.mixed_step`; `replays_mixed` says when): rows ``[0, len(chunks))`` take
        their next ``chunks[i]`` tokens (left-padded to the recorded length), every other row its last sampled
        token. Returns the sampled (request, token, logprob) of the rows that have then fed everything they had."""
        rows, k = self.rows, len(chunks)
        length = cuda_graphs.short_prefill_length(self.cache, k, max(chunks))
        ids = torch.zeros(k, length, dtype=torch.long)
        for i, (request, n) in enumerate(zip(rows, chunks)):
            ids[i, length - n:] = torch.tensor(request.next_tokens(n))
        logits = self._forward_mixed(ids, chunks, int_tensor([r.next_token() for r in rows[k:]]))
        counts = list(chunks) + [1] * (len(rows) - k)
        for request, n in zip(rows, counts):
            request.held += n
        if self.cache.prefix is not None:
            self._after_step(rows, counts)
        return self._sample(rows, logits)

    def _feeds_embeddings(self, rows: list[Request]) -> bool:
        """Whether a row feeds prompt tokens whose embeddings its media encoding gives (the eager forward's inputs)."""
        return bool(self.encoded) and any(r in self.encoded and r.held < len(r.prompt) for r in rows)

    def can_group(self) -> bool:
        """Whether the next step may be a grouped step (`grouped`): the model runs them (a text model of ours) and
        no row still feeds prompt tokens whose embeddings its media encoding gives."""
        if not hasattr(self.model, "grouped_head"):
            return False
        return not self._feeds_embeddings(self.rows)

    def grouped(self, chunks: list[int],
                drafts: list[list[int]] | None = None) -> list[tuple[Request, int, float | None]]:
        """One grouped step (`hf_qsa_cache.grouped`): rows ``[0, len(chunks))`` take their next ``chunks[i]`` tokens,
        each row a group of its own (neighbours with chunks of one length one group), and every decoding row its
        last sampled token, together one group: no pads. Rows still prefilling without a chunk take nothing (they
        wait for a chunk, or for a prefix an older row is caching: they may restore it yet); inside the decoding
        rows' group they are all pads, after the last decoding row not in the step. With ``drafts`` (one list per
        row after the chunks' rows), decoding rows also take their drafts and the step verifies them as `decode`
        does (that group is then left-padded to its longest row). Returns the sampled (request, token, logprob), a
        row's in order, of the rows that have then fed everything they had."""
        rows, k = self.rows, len(chunks)
        rest = rows[k:]
        while rest and rest[-1].in_prefill:  # (decoding rows come last: this leaves them, or nothing)
            rest = rest[:-1]
        drafts = drafts[:len(rest)] if drafts and any(drafts) else [[] for _ in rest]
        width = 1 + max((len(d) for d in drafts), default=0)  # the decoding rows' group's columns
        shape = []  # neighbouring chunks of one length share a rectangle (fewer launches, still no pads)
        for n in chunks:
            if shape and shape[-1][1] == n:
                shape[-1] = (shape[-1][0] + 1, n)
            else:
                shape.append((1, n))
        if rest:
            shape.append((len(rest), width))
        counts = list(chunks) + [0 if r.in_prefill else 1 + len(d) for r, d in zip(rest, drafts)]
        ids, keep, end = [], [], 0
        for request, n in zip(rows[:k], chunks):
            ids += request.next_tokens(n)
            end += n
            keep.append(end - 1)  # a prefill row's last token: its logits sample the next one
        for request, guess, n in zip(rest, drafts, counts[k:]):
            ids += [0] * (width - n) + (request.next_tokens(1) + guess if n else [])
            keep += range(end, end + width)  # a decoding row's columns: its token's logits, then each draft's
            end += width
        fed = rows[:k + len(rest)]
        logits = self._forward_grouped(fed, shape, counts, ids, keep)
        for request, n in zip(fed, counts):
            request.held += n
        picked, drops = self._sample(rows[:k], logits[:k]) if k else [], []
        if rest:  # (a row that took nothing has work left: `_sample` skips it)
            verified, drops = self._verify(rest, drafts, logits[k:].view(len(rest), width, -1))
            picked += verified
        if any(drops):
            crop_rows(self.cache, [0] * k + drops + [0] * (len(rows) - len(fed)))
        if self.cache.prefix is not None:  # (after the crop: each row's state is at what it holds)
            self._after_step(rows[:len(fed)], counts)
        return picked

    def decode(self, drafts: list[list[int]] | None = None) -> list[tuple[Request, int, float | None]]:
        """Every row takes one token (its last sampled token, or its next prompt token); with ``drafts``, row
        ``i`` then takes ``drafts[i]`` too (prompt lookup's guesses of its next tokens, greedy rows only), and
        the step verifies them: a row keeps its drafts up to the first its own logits disagree with, plus the
        token those logits give, and the cache drops the rest of its row. Returns the sampled (request, token,
        logprob), a row's in order."""
        rows = self.rows
        if not drafts or not any(drafts):
            ids = int_tensor([r.next_token() for r in rows]).view(-1, 1)
            logits = self._forward(rows, ids, None)
            for request in rows:
                request.held += 1
            if self.cache.prefix is not None:
                self._after_step(rows)
            return self._sample(rows, logits[:, -1])
        length = 1 + max(len(d) for d in drafts)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for i, (request, guess) in enumerate(zip(rows, drafts)):
            fed = request.next_tokens(1) + guess
            ids[i, length - len(fed):] = torch.tensor(fed)
            mask[i, length - len(fed):] = 1
        logits = self._forward(rows, ids, mask, keep=length)
        for request, guess in zip(rows, drafts):
            request.held += 1 + len(guess)
        picked, drops = self._verify(rows, drafts, logits)
        if any(drops):
            crop_rows(self.cache, drops)
        if self.cache.prefix is not None:  # (after the crop: each row's state is at what it holds)
            self._after_step(rows)
        return picked

    def _verify(self, rows: list[Request], drafts: list[list[int]], logits: torch.Tensor):
        """``(picked, drops)`` of a step that fed row ``i`` its token and ``drafts[i]`` (left-padded; ``logits``
        ``[rows, columns, vocab]`` of its last columns, rows already advanced past what they fed): a row with no
        drafts samples its next token; a drafting row keeps its drafts up to the first its own logits disagree
        with, plus the token those logits give, and drops the rest (``drops[i]``, taken off its ``held``; the
        caller crops the cache)."""
        length = logits.shape[1]
        plain = [i for i, guess in enumerate(drafts) if not guess]
        picked = self._sample([rows[i] for i in plain], logits[plain, -1]) if plain else []
        drops = [0] * len(rows)
        drafted = [i for i, guess in enumerate(drafts) if guess]
        greedy = logits[drafted].argmax(dim=-1).tolist() if drafted else []  # one read of the device
        for i, best_row in zip(drafted, greedy):
            guess = drafts[i]
            request, m = rows[i], len(guess)
            best = best_row[length - 1 - m:]  # after the row's last token, then after each draft
            kept = 0
            while kept < m and best[kept] == guess[kept]:
                kept += 1
            tokens = guess[:kept] + [best[kept]]
            logprobs = [None] * len(tokens)
            if self.return_logprobs or request.want_logprobs:
                scores = logits[i, length - 1 - m: length - m + kept].float()
                picked_ids = torch.tensor(tokens, device=scores.device)[:, None]
                logprobs = scores.log_softmax(-1).gather(1, picked_ids)[:, 0].tolist()
            picked += [(request, t, lp) for t, lp in zip(tokens, logprobs)]
            drops[i] = m - kept
            request.held -= drops[i]
        return picked, drops

    def _forward(self, rows: list[Request], ids: torch.Tensor, mask: torch.Tensor | None,
                 keep: int = 1) -> torch.Tensor:
        """The logits ``[rows, keep, vocab]`` of the step's last ``keep`` columns."""
        ids = ids.to(self.device)
        mask = None if mask is None else mask.to(self.device)
        if self._feeds_embeddings(rows):
            # Prompt tokens of a multimodal request: the model's encoding gives their embeddings (and positions).
            inputs = self.model.prompt_step_inputs(ids, mask, [(self.encoded.get(r), r.held) for r in rows],
                                                   self.cache)
        else:
            # A step the recorded (CUDA-graph) step takes goes straight to it: the model's forward routes it there
            # too, through wrappers and an output object that cost a decode iteration a fifth of its host work. (Only
            # logits are read here: outputs a model's config asks for do not keep a step off the graphs.)
            graphs = decode_graphs_for(self.model, self.cache, ids, None, extra_outputs=False, logits_to_keep=keep)
            if graphs is not None:
                with self.cache.forward_scope():
                    logits = graphs.step(ids, None, mask)[:, -keep:]
                self.graphs_checked = True
                return logits
            inputs = {"input_ids": ids}
        out = self.model(**inputs, attention_mask=mask, past_key_values=self.cache, use_cache=True,
                         logits_to_keep=keep)
        self._ran_eagerly()
        return out.logits[:, -keep:]

    def _forward_grouped(self, rows: list[Request], shape: list[tuple[int, int]], counts: list[int], ids: list[int],
                         keep: list[int]) -> torch.Tensor:
        """The logits ``[len(keep), vocab]`` at the step's token indices ``keep`` of a grouped step (``shape``: its
        groups, ``counts``: each row's tokens, ``ids``: the tokens, rectangle after rectangle)."""
        logits = grouped_logits(self.model, self.cache, shape, counts, torch.tensor([ids], device=self.device),
                                torch.tensor(keep, device=self.device))
        self._ran_eagerly()
        return logits

    def _forward_mixed(self, ids: torch.Tensor, chunks: list[int], decoding: torch.Tensor) -> torch.Tensor:
        """The logits ``[rows, vocab]`` of a mixed step (`mixed`: the chunks' rows' ``ids``, the decoding rows'
        tokens)."""
        with self.cache.forward_scope():
            logits = recorded_steps(self.model, self.cache).mixed_step(ids.to(self.device), chunks,
                                                                        decoding.to(self.device))
        self.graphs_checked = True
        return logits

    def _ran_eagerly(self) -> None:
        """An eager step of this loop landed: after a recorded step of this session, the recorded steps learn that it
        was the loop's own."""
        graphs = self.cache.graph_runners.get(self.model) if self.graphs_checked else None
        if graphs is not None:
            graphs.steps_were_own()

    def _sample(self, rows: list[Request], logits: torch.Tensor) -> list[tuple[Request, int, float | None]]:
        """The next token of each row that has fed everything it had: the argmax of its scores (greedy) or a
        draw with one uniform number from its seed and the token's index (`token_uniform`), after its penalties
        and warpers: `sampling.next_token_scores`'s arithmetic for all rows at once (the penalties from each
        request's history table, `PenaltyTables.apply`; the warpers, `warp_rows`; the draw, `draw`)."""
        if self.plain_rows and not self.return_logprobs:  # (the argmax of bf16 scores is that of their fp32 values)
            return [(r, t, None) for r, t in zip(rows, logits.argmax(dim=-1).tolist()) if r.pending == 0]
        ready = [i for i, r in enumerate(rows) if r.pending == 0]
        if not ready:
            return []
        logits = (logits if len(ready) == len(rows) else logits[ready]).float()
        scores = logits
        requests = [rows[i] for i in ready]
        penalized = [j for j, r in enumerate(requests) if r.sampling.penalized]
        sampled = [j for j, r in enumerate(requests) if r.sampling.do_sample]
        if penalized or sampled:  # (an all-greedy step is one argmax)
            scores = logits.clone()
        if penalized:
            if self.penalties is None:
                self.penalties = PenaltyTables(self.cache.max_batch_size, logits.shape[-1], logits.device)
            rows_penalized = int_tensor(penalized).to(scores.device, non_blocking=True)
            slots = self.penalties.slots([requests[j] for j in penalized])
            scores[rows_penalized] = self.penalties.apply(scores[rows_penalized], slots,
                                                          [requests[j].sampling for j in penalized])
        if sampled:
            rows_sampled = int_tensor(sampled).to(scores.device, non_blocking=True)
            scores[rows_sampled] = warp_rows(scores[rows_sampled], [requests[j].sampling for j in sampled])
        tokens = scores.argmax(dim=-1)
        if sampled:
            uniforms = torch.tensor([token_uniform(requests[j].seed, len(requests[j].generated)) for j in sampled],
                                    dtype=torch.float64)
            tokens[rows_sampled] = draw(scores[rows_sampled], uniforms)
        if penalized:
            self.penalties.took(slots, tokens[rows_penalized])
        logprobs = None
        if self.return_logprobs or any(rows[i].want_logprobs for i in ready):
            logprobs = scores.log_softmax(-1).gather(1, tokens[:, None])[:, 0].tolist()
        if logprobs is None:
            return [(rows[i], token, None) for i, token in zip(ready, tokens.tolist())]
        picked = []
        for j, (i, token) in enumerate(zip(ready, tokens.tolist())):
            request = rows[i]
            keep = self.return_logprobs or request.want_logprobs
            picked.append((request, token, logprobs[j] if keep else None))
        return picked


def splice_prompt_embeddings(embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                             rows: list[tuple[dict | None, int]]) -> list[tuple[slice, torch.Tensor]]:
    """For a multimodal model's `prompt_step_inputs`: in a left-padded step ``embeds [B, L, hidden]`` (the
    token embeddings), the columns of row ``b`` that are prompt tokens of an encoded request (``rows[b] =
    (encoding, tokens the row holds)``, the encoding's ``"embeds" [n, hidden]``) take the encoding's
    embeddings, in place. Returns each row's ``(real columns, their logical positions)``."""
    B, L = embeds.shape[:2]
    counts = [L] * B if attention_mask is None else attention_mask[:, -L:].sum(dim=1).tolist()
    spans = []
    for b, (encoded, held) in enumerate(rows):
        cols = slice(L - counts[b], L)
        logical = held + torch.arange(counts[b], device=embeds.device)
        if encoded is not None:
            prompt = logical < encoded["embeds"].shape[0]
            row = embeds[b, cols].clone()
            row[prompt] = encoded["embeds"][logical[prompt]].to(embeds.dtype)
            embeds[b, cols] = row
        spans.append((cols, logical))
    return spans
