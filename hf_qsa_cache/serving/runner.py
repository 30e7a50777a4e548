"""The model and its cache in the continuous-batching loop: keeps the cache's rows in the scheduler's
order, runs each step's forward, samples the next tokens."""

from __future__ import annotations

import torch

from ..cache import QSAPagedCache
from ..rollback import crop_rows
from .requests import Request
from .sampling import next_token_scores


class ModelRunner:
    def __init__(self, model, cache: QSAPagedCache, return_logprobs: bool = False):
        self.model = model
        self.cache = cache
        self.return_logprobs = return_logprobs
        self.device = next(model.parameters()).device
        self.rows: list[Request] = []  # the cache's rows, in order
        # A multimodal prompt's encoding (`model.encode_prompt`: its embeddings, positions), by request, kept
        # until the request ends (a preempted request feeds its prompt again). Keyed by the request itself (it
        # hashes by identity), never by id(): an ended request's id can be a new request's.
        self.encoded: dict[Request, dict] = {}

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
        if order:
            self.cache.move_rows(src)
        else:
            self.cache.reset()  # no request holds a row
        for request, s in zip(order, src):
            if s == -1:
                request.held = 0
        self.rows = list(order)

    def release_all(self) -> None:
        """Every row back (the loop ended): the cache is reset, whatever state a failure left it in."""
        self.cache.reset()
        self.rows = []

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
        return self._sample(rows, logits[:, -1])

    def decode(self, drafts: list[list[int]] | None = None) -> list[tuple[Request, int, float | None]]:
        """Every row takes one token (its last sampled token, or its next prompt token); with ``drafts``, row
        ``i`` then takes ``drafts[i]`` too (prompt lookup's guesses of its next tokens, greedy rows only), and
        the step verifies them: a row keeps its drafts up to the first its own logits disagree with, plus the
        token those logits give, and the cache drops the rest of its row. Returns the sampled (request, token,
        logprob), a row's in order."""
        rows = self.rows
        if not drafts or not any(drafts):
            ids = torch.tensor([r.next_tokens(1) for r in rows], dtype=torch.long)
            logits = self._forward(rows, ids, None)
            for request in rows:
                request.held += 1
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
        plain = [i for i, guess in enumerate(drafts) if not guess]
        picked = self._sample([rows[i] for i in plain], logits[plain, -1]) if plain else []
        drops = [0] * len(rows)
        for i, guess in enumerate(drafts):
            if not guess:
                continue
            request, m = rows[i], len(guess)
            scores = logits[i, length - 1 - m:].float()  # after the row's last token, then after each draft
            best = scores.argmax(dim=-1).tolist()
            kept = 0
            while kept < m and best[kept] == guess[kept]:
                kept += 1
            tokens = guess[:kept] + [best[kept]]
            logprobs = [None] * len(tokens)
            if self.return_logprobs or request.want_logprobs:
                logprobs = scores[: kept + 1].log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
            picked += [(request, t, lp) for t, lp in zip(tokens, logprobs)]
            drops[i] = m - kept
            request.held -= drops[i]
        if any(drops):
            crop_rows(self.cache, drops)
        return picked

    def _forward(self, rows: list[Request], ids: torch.Tensor, mask: torch.Tensor | None,
                 keep: int = 1) -> torch.Tensor:
        """The logits ``[rows, keep, vocab]`` of the step's last ``keep`` columns."""
        ids = ids.to(self.device)
        mask = None if mask is None else mask.to(self.device)
        if self.encoded and any(r in self.encoded and r.held < len(r.prompt) for r in rows):
            # Prompt tokens of a multimodal request: the model's encoding gives their embeddings (and positions).
            inputs = self.model.prompt_step_inputs(ids, mask, [(self.encoded.get(r), r.held) for r in rows],
                                                   self.cache)
        else:
            inputs = {"input_ids": ids}
        out = self.model(**inputs, attention_mask=mask, past_key_values=self.cache, use_cache=True,
                         logits_to_keep=keep)
        return out.logits[:, -keep:]

    def _sample(self, rows: list[Request], logits: torch.Tensor) -> list[tuple[Request, int, float | None]]:
        """The next token of each row that has fed everything it had: the argmax of its scores (greedy) or a
        draw from its own random stream, after its penalties and warpers (`sampling.next_token_scores`)."""
        ready = [i for i, r in enumerate(rows) if r.pending == 0]
        if not ready:
            return []
        logits = (logits if len(ready) == len(rows) else logits[ready]).float()
        scores = logits
        processed = [j for j, i in enumerate(ready) if not rows[i].sampling.plain_greedy]
        if processed:  # penalties and warpers, row by row (an all-greedy step is one argmax)
            scores = logits.clone()
            for j in processed:
                request = rows[ready[j]]
                scores[j] = next_token_scores(logits[j], request.sampling, request.prompt, request.generated)
        tokens = scores.argmax(dim=-1)
        for j in processed:
            request = rows[ready[j]]
            if request.sampling.do_sample:
                tokens[j] = torch.multinomial(scores[j].softmax(-1), 1, generator=_generator(request, logits.device))[0]
        logprobs = None
        if self.return_logprobs or any(rows[i].want_logprobs for i in ready):
            logprobs = scores.log_softmax(-1).gather(1, tokens[:, None])[:, 0].tolist()
        picked = []
        for j, (i, token) in enumerate(zip(ready, tokens.tolist())):
            request = rows[i]
            keep = logprobs is not None and (self.return_logprobs or request.want_logprobs)
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


def _generator(request: Request, device: torch.device) -> torch.Generator:
    """The request's own random stream: its draws do not depend on what it was batched with."""
    if request.generator is None:
        request.generator = torch.Generator(device=device)
        if request.seed is not None:
            request.generator.manual_seed(request.seed)
        else:
            request.generator.seed()
    return request.generator
