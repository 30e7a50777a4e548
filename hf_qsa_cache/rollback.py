"""Exact rollback of the state a speculative verify step overwrites in place (Qwen4Exp).

A verify step writes ``k + 1`` tokens (the last accepted one and ``k`` drafts); `QSAPagedCache.crop`
then drops the rejected drafts. What makes that exact, per kind of state:

* Paged K/V (main, sliding), Inkling's conv taps, QSA compressed keys: addressed by position, so
  shortening a row is enough. Windowed tables keep ``num_speculative_tokens`` positions more than the
  next query reads (`stores.inkling`), the QSA raw-key ring as many more keys (`stores.qsa_index`).
* GatedDeltaNet recurrent state and conv window, PLE conv window and n-gram context (Qwen4Exp):
  overwritten in place every step. With ``num_speculative_tokens = k`` each forward keeps the state
  after each of a row's last ``k + 1`` positions in a per-row ring (`stores.linear_state`); the
  recurrent states of those positions come from running the recurrence one token at a time
  (`gated_delta_keeping_states`). ``crop(-n)`` copies back the state after position ``length - 1 - n``.

How far back a row can go: the ring holds the state after each of the last ``k + 1`` positions the row
reached, so it can be cropped to any length down to ``k`` below the longest length it has had; crops in
a row share that budget (`rollback_floor`).
"""

from __future__ import annotations

import torch

from .blocks import NULL_BLOCK
from .ops.gated_delta import chunked_rule


def step_history(cache, state, device, num_rows: int, query_len: int):
    """``(m, slots)`` for a linear-state store that keeps rollback history, else None. The same for every
    layer of the step (the stores share their ring layout), so computed once per step."""
    if not state.history:
        return None
    meta = cache.step_metadata(device)
    return meta.derived(("history_slots", state.history, state.max_rows, num_rows, query_len),
                        lambda: state.history_slots(meta.position, num_rows, query_len))


def gated_delta_keeping_states(chunk_rule, recurrent_rule, query, key, value, g, beta, initial_state, keep: int,
                               meta=None):
    """The gated delta rule over ``[B, L, ...]`` inputs, also returning the recurrent state after each of
    the last ``keep`` tokens.

    The first ``L - keep`` tokens run as one chunked pass; the last ``keep`` run one at a time through
    the recurrent rule (a decode step does exactly that, so verifying a draft costs the same arithmetic
    as decoding it). Returns ``(core [B, L, Hv, Dv], final state, states [B, keep, Hv, Dk, Dv])``. ``meta``: the
    step's metadata (`chunked_rule`).
    """
    L = query.shape[1]
    head = L - keep
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    outs, states = [], []
    state = initial_state
    if head > 0:  # (rows packed where the kernel takes them: `chunked_rule`)
        out, state = chunked_rule(chunk_rule, query[:, :head], key[:, :head], value[:, :head], g[:, :head],
                                  beta[:, :head], state, meta)
        outs.append(out)
    for t in range(head, L):
        s = slice(t, t + 1)
        out, state = recurrent_rule(query[:, s], key[:, s], value[:, s], g=g[:, s], beta=beta[:, s],
                                    initial_state=state, **kwargs)
        outs.append(out)
        states.append(state)
    if head == 0 and keep == 1:  # a one-token step (every decode step of a cache with headroom): no copies
        return outs[0], state, state.unsqueeze(1)
    return torch.cat(outs, dim=1), state, torch.stack(states, dim=1)


def rollback_floor(cache, row: int) -> int:
    """The shortest length ``row`` can be cropped to on a Qwen4Exp cache (ring history and QSA ring)."""
    rows = cache.rows
    if cache.num_speculative_tokens == 0:
        return rows.lengths[row]
    return max(0, rows.crop_floor[row], rows.lengths[row] - cache.num_speculative_tokens)


def check_linear_rollback(cache, drops: list[int]) -> None:
    """Raise unless every row ``b`` of a Qwen4Exp cache can drop ``drops[b]`` tokens (before anything changes)."""
    limit = cache.num_speculative_tokens
    if limit == 0:
        drop = max(drops)
        raise ValueError(
            f"cannot drop {drop} tokens: this Qwen4Exp cache keeps no rollback history for its recurrent state "
            f"(num_speculative_tokens=0); build it with num_speculative_tokens={drop} or more"
        )
    for b, drop in enumerate(drops):
        length, floor = cache.lengths[b], rollback_floor(cache, b)
        if drop == 0 or drop <= length - floor:
            continue
        if cache.rows.crop_floor[b] <= length - limit:  # the headroom bounds it
            raise ValueError(
                f"cannot drop {drop} tokens: row {b} can go back {length - floor} at most (num_speculative_tokens="
                f"{limit}: the cache keeps the state after each of the last {limit + 1} positions a row reached)"
            )
        # The row's floor bounds it. Only a failed step raises a floor past the row's length (`Step.abort`);
        # a floor at or below it may also come from an earlier crop.
        cause = "a failed step overwrote its rollback state"
        if floor <= length:
            cause += (" of shorter lengths, or an earlier crop went back that far (crops share the budget of "
                      f"num_speculative_tokens={limit})")
        raise ValueError(
            f"cannot drop {drop} tokens: row {b} can go back {max(length - floor, 0)} at most: it holds {length} "
            f"tokens and may be cropped to length {floor} at the shortest{', once longer' if floor > length else ''}, "
            f"because {cause}"
        )


def restore_linear_states(cache, rows: list[int], new_lengths: list[int]) -> None:
    """Row ``rows[i]`` of a Qwen4Exp cache takes its recurrent / conv / PLE state after position ``new_lengths[i] -
    1``, from its rollback ring. Only the rows a crop shortens: a row that took no token in the last step (a row
    waiting beside a grouped step's others, one just started from a cached prefix) may have nothing of its state
    in its ring, and its state is already where it stays."""
    for b in rows:
        # What the ring held before this crop bounds every later crop until the row grows past it.
        cache.rows.raise_crop_floor(b, cache.lengths[b] - cache.num_speculative_tokens)
    plans: dict = {}  # the index tensors, built once per device for every layer's store
    for layer in cache.layers:
        linear = layer.stores.get("linear")
        if linear is not None:
            linear.restore(rows, new_lengths, plans)


def _check_windows(cache, drops: list[int]) -> None:
    """Raise unless every windowed table still holds what each row ``b``, ``drops[b]`` tokens shorter, reads
    next: windowed tables keep ``num_speculative_tokens`` positions beyond what the next query reads, no more."""
    for name, table in cache.tables.items():
        if table.window is None:
            continue
        reach = table.window - cache.num_speculative_tokens
        for b, drop in enumerate(drops):
            if drop == 0:
                continue
            new_len = cache.lengths[b] - drop
            lo = max(0, new_len - reach + 1)
            needed = table.rows[b][lo // table.block_size: -(-new_len // table.block_size)]
            if lo < new_len and NULL_BLOCK in needed:
                raise ValueError(
                    f"cannot drop {drop} tokens: row {b} needs position {lo} of the {name} window, already "
                    f"freed (the cache keeps num_speculative_tokens={cache.num_speculative_tokens} extra)"
                )


def crop_rows(cache, drop: int | list[int]) -> None:
    """Every row of ``cache`` drops its last ``drop`` tokens, or row ``b`` its last ``drop[b]`` (continuous
    batching's verify steps: each row kept its own accepted drafts). Paged stores roll back by shortening (they
    are addressed by position); Qwen4Exp's per-row states are copied back from their rollback ring. Refused
    before anything changes if a row is too short or the cache kept too little."""
    drops = [drop] * cache.num_rows if isinstance(drop, int) else list(drop)
    if len(drops) != cache.num_rows or min(drops, default=0) < 0:
        raise ValueError(f"a crop needs one count >= 0 for each of the cache's {cache.num_rows} rows, got {drop}")
    most = max(drops, default=0)
    if most == 0:
        return
    if most > cache.columns_seen:
        raise ValueError(f"cannot drop {most} tokens, the cache holds {cache.columns_seen} columns")
    for b in range(cache.num_rows):
        if cache.lengths[b] < drops[b]:
            raise ValueError(f"row {b} holds {cache.lengths[b]} tokens, cannot drop {drops[b]}")
    for b in range(cache.num_rows):
        if drops[b] and any(t.shares_from(b, cache.lengths[b] - drops[b]) for t in cache.tables.values()):
            shared = max(t.shared_columns(b) * t.block_size for t in cache.tables.values())
            raise ValueError(
                f"cannot drop {drops[b]} tokens: row {b} holds {cache.lengths[b]} tokens and shares its first "
                f"{shared} with cached prefixes (prefix_caching) or with rows copied from it or it from them "
                "(beam search, repeat), which no row may write"
            )
    qwen = cache.model_family == "qwen4_exp"
    if qwen:
        check_linear_rollback(cache, drops)
    _check_windows(cache, drops)
    if qwen:
        before = cache.rows.snapshot()
        cropped = [b for b in range(cache.num_rows) if drops[b]]
        try:
            restore_linear_states(cache, cropped, [cache.lengths[b] - drops[b] for b in cropped])
        except BaseException as error:
            # Some layers may hold the cropped state already: put every layer back to the current lengths
            # (the ring holds the state after each row's last position, which the checks above guarantee),
            # or refuse further steps.
            try:
                restore_linear_states(cache, cropped, [cache.lengths[b] for b in cropped])
                cache.rows.restore(before)  # the floors before this crop (restoring raises them)
            except BaseException:
                cache.mark_unusable(f"a crop failed half way ({type(error).__name__}: {error})")
            raise
    cache.rows.shorten(drops)
    for b in range(cache.num_rows):
        for table in cache.tables.values():
            table.truncate(b, cache.lengths[b])
