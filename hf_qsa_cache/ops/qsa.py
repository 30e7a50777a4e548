"""QSA ops, torch reference (the specification; runs on CPU and GPU).

Tokens are the flattened ``[B*L]`` rows of a forward, described by `StepMetadata`. Compressed group
``g`` of a row covers logical positions ``g*r .. g*r+r-1``; a query at position ``p`` may score its
row's groups ``0 .. visible_blocks-1``, keeps the ``budget / r`` best, and always attends the
open-group tail ``((p+1)//r)*r .. p``.

At long context the selection ranks tile maxima instead of holding every score (`select_by_tile_maxima`,
from ``SELECT_BY_TILES_MIN_GROUPS`` groups on the GPU).

On CUDA the index scores and the sparse attention run as Triton kernels (`hf_qsa_cache.ops.qsa_triton`),
tested against the torch functions here (under the Triton interpreter, on GPU by
``benchmarks/check_qsa_kernels.py``, and inside whole models by ``benchmarks/gpu_checks.py``). The ranking of
the best groups is `hf_qsa_cache.ops.top_set`.
"""

from __future__ import annotations

import math

import torch

from . import fusions, records_grad, top_set, use_triton
from .fp8 import dequantize_fp8
from .row_writes import RowWrites
from .selected_positions import selected_positions
from .metadata_ref import StepMetadata
from .top_set import tile_maxima, top_group_set, top_groups_of_best_tiles

# Upper bound on the elements one chunk of scores / gathered K/V may take (selection at long context
# holds about 16 bytes per (token, group) in a chunk: 2 GiB at this bound).
_CHUNK_ELEMENTS = 1 << 27

# The QSA index arithmetic (group pooling, selected positions) in one launch each: ``qsa`` in `hf_qsa_cache.fusions`.
# ``qsa_topk``: a selection's set of best groups in one launch, no sort (`top_group_set`).
# ``qsa_gate``: a decode step's output gate, ``sigmoid(gate) * attention``, in the merge of the attention's splits
# (`gated_sparse_paged_attention`): two torch launches a QSA layer less.


def paged_rows(block_table: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """Flat store row of logical item ``index`` (token or compressed group) of cache row ``rows``."""
    block = block_table[rows, (index // rows_per_block).clamp_max(block_table.shape[1] - 1)].long()
    return block * rows_per_block + index % rows_per_block


def qsa_index_step(q_index: torch.Tensor, raw_keys: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                   store, block_size: int, block_topk: int, finish_group, writes: RowWrites) -> torch.Tensor:
    """One QSA layer's indexer for one forward: compress the groups this forward closes, commit the
    raw keys to the ring, select. Returns the selected positions (`score_and_select`).

    q_index ``[N, Hi, Di]`` normed, rotated index queries; raw_keys ``[N, Di]`` and positions ``[N, 3]``
    of this forward's tokens; store: the layer's `QSAIndexStore`; ``finish_group(mean_raw_key [W, Di],
    first_position [W, 3])`` turns a closed group's mean raw key into its compressed key (the model's
    norm and rotary). ``writes``: the layer's other writes of the step (its K/V), flushed with the indexer's in one
    launch where fused, before the selection reads the compressed keys.
    """
    r = store.ratio
    # Most decode steps close no group (one step in r does); when the host knows, skip the work.
    # The rows written below are the same in every QSA layer of the step: computed once per step.
    if meta.closes_groups(r):
        pooled, first_pos = pool_groups(meta, meta.compress_work, r, store.ring_keys, store.ring_positions,
                                        store.capacity, raw_keys, positions)
        rows = meta.derived(("group_rows", store.table, store.rows_per_block),
                            lambda: store.group_rows(meta.compress_work, meta.block_tables[store.table]))
        store.write_groups(rows, finish_group(pooled, first_pos), writes)
    # Only after the groups above read it: the ring keeps the newest raw keys of each row.
    rows = meta.derived(("ring_rows", store.max_rows, store.capacity), lambda: store.ring_rows(meta.ring_slot))
    store.write_ring(rows, raw_keys, positions, writes)
    writes.flush()
    if store.compressed_scales is None:
        return score_and_select(q_index, store.compressed, meta, store.table, block_size, r, block_topk)
    return score_and_select(q_index, store.compressed, meta, store.table, block_size, r, block_topk,
                            scales=store.compressed_scales)


def pool_groups(meta: StepMetadata, work: torch.Tensor, ratio: int, ring_keys: torch.Tensor,
                ring_positions: torch.Tensor, capacity: int, raw_keys: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean raw key ``[W, Di]`` (fp32 mean, in ``raw_keys``' dtype) of each work group and the 3-axis
    position ``[W, 3]`` of its first token (`gather_group_raw_keys`). One launch where fused
    (the ``qsa`` fusion, `qsa_triton.pool_groups_triton`)."""
    if fusions.enabled("qsa") and raw_keys.is_cuda and not records_grad(raw_keys):
        from .qsa_triton import pool_groups_triton

        return pool_groups_triton(work, meta.prev_len, meta.count, meta.query_len, ratio, ring_keys, ring_positions,
                                  capacity, raw_keys, positions)
    keys, first_pos = gather_group_raw_keys(meta, work, ratio, ring_keys, ring_positions, capacity, raw_keys,
                                            positions)
    return keys.float().mean(dim=1).to(raw_keys.dtype), first_pos


def gather_group_raw_keys(meta: StepMetadata, work: torch.Tensor, ratio: int, ring_keys: torch.Tensor,
                          ring_positions: torch.Tensor, capacity: int, raw_keys: torch.Tensor,
                          positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw keys ``[W, r, Di]`` of each work group, and the 3-axis position ``[W, 3]`` of its first token.

    A group's tokens from this forward come from ``raw_keys``/``positions`` (``[B*L, ...]``); earlier
    ones from the row's ring, which still holds them because the group was open.
    """
    # Where each group token lives is the same in every QSA layer of the step: computed once.
    in_chunk, chunk_token, ring_row = meta.derived(
        ("group_sources", ratio, capacity, raw_keys.shape[0]),
        lambda: group_token_sources(meta, work, ratio, capacity, raw_keys.shape[0]))
    keys = torch.where(in_chunk[..., None], raw_keys[chunk_token], ring_keys[ring_row].to(raw_keys.dtype))
    first_pos = torch.where(in_chunk[:, :1], positions[chunk_token[:, 0]], ring_positions[ring_row[:, 0]])
    return keys, first_pos


def group_token_sources(meta: StepMetadata, work: torch.Tensor, ratio: int, capacity: int,
                        num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(in_step, step_token, ring_row)``, each ``[W, r]``: whether each work group's token is among this
    forward's ``num_tokens`` tokens, its index there (clamped) and its row in the ring."""
    row = work[:, 0].long().clamp_min(0)
    group = work[:, 1].long().clamp_min(0)
    pos = group[:, None] * ratio + torch.arange(ratio, device=work.device)  # [W, r]
    prev = meta.prev_len.long()[row][:, None]
    count = meta.count.long()[row][:, None]
    L = meta.query_len
    step_token = (row[:, None] * L + (L - count) + (pos - prev)).clamp(0, num_tokens - 1)
    return pos >= prev, step_token, row[:, None] * capacity + pos % capacity


def score_and_select(q_index: torch.Tensor, compressed: torch.Tensor, meta: StepMetadata, table: str,
                     block_size: int, ratio: int, block_topk: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Selected token positions ``[B*L, block_topk*r + r - 1]`` (-1 = unused), selected blocks first.

    q_index: ``[B*L, Hi, Di]`` normed and rotated index queries; compressed: ``[num_blocks, block_size/r, Di]``;
    ``scales`` ``[num_blocks, block_size/r]``: an fp8 store's scales (`fp8`), None for a store in the model's dtype.
    Score of group b: ``sum_h relu(q_h . k_b) / sqrt(Di)``, top ``min(block_topk, visible)`` kept. Among equal
    scores at the cut, the torch path (the CPU) keeps what transformers' ``torch.topk`` over the token's visible
    groups keeps (`top_set.top_group_set_as_topk`); the Triton path (CUDA) keeps the lower group index, as
    ``torch.topk`` does on CUDA.
    """
    n = q_index.shape[0]
    device = q_index.device
    rows_per_block = block_size // ratio
    max_groups = meta.max_seq_len // ratio
    pos = meta.position
    visible = meta.visible_blocks
    if max_groups == 0:
        return selected_positions(torch.empty(n, 0, dtype=torch.long, device=device), visible, pos, ratio, block_topk)

    table_t = meta.block_tables[table]
    k = min(block_topk, max_groups)
    by_tiles = selects_by_tiles(q_index, max_groups, k)
    # Tokens per chunk: what a chunk holds per token is its scores, or its tile maxima and candidates.
    held = -(-max_groups // top_set.TOPK_TILE) + k * top_set.TOPK_TILE if by_tiles else max_groups
    step = max(1, _CHUNK_ELEMENTS // held)
    scores_fn = index_scores_torch
    if use_triton(q_index):
        from .qsa_triton import index_scores_triton as scores_fn
    # The torch path keeps the tied groups transformers' torch.topk keeps (from each token's visible count); the
    # Triton path the lower group index.
    ties_as_topk = not use_triton(q_index)
    chosen = []
    extra = {} if scales is None else {"scales": scales}  # an fp8 store's (the calls of before otherwise)
    for start in range(0, n, step):
        end = start + step
        args = (q_index[start:end], compressed, table_t, meta.token_row[start:end], visible[start:end],
                rows_per_block)
        if by_tiles:
            groups = select_by_tile_maxima(*args, max_groups, k, **extra).sort(dim=-1).values
        else:
            groups = top_group_set(scores_fn(*args, max_groups, **extra), k,
                                   visible[start:end] if ties_as_topk else None)
        chosen.append(selected_positions(groups, visible[start:end], pos[start:end], ratio, block_topk))
    return chosen[0] if len(chosen) == 1 else torch.cat(chosen, dim=0)


def selects_by_tiles(q_index: torch.Tensor, max_groups: int, k: int) -> bool:
    """Whether `score_and_select` ranks tile maxima (`select_by_tile_maxima`) instead of every score: with the
    Triton kernels, from ``SELECT_BY_TILES_MIN_GROUPS`` groups on (where it measured faster), and where the
    groups make at least two tiles per pick."""
    return use_triton(q_index) and max_groups >= SELECT_BY_TILES_MIN_GROUPS and max_groups >= 2 * k * top_set.TOPK_TILE


def select_by_tile_maxima(q_index: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                          token_row: torch.Tensor, visible_blocks: torch.Tensor, rows_per_block: int,
                          max_groups: int, k: int, tile: int | None = None,
                          scales: torch.Tensor | None = None) -> torch.Tensor:
    """`top_groups` of the index scores (`index_scores_torch`) from each tile's best score only
    (`index_tile_maxima_torch`): the groups of the ``k`` best tiles are scored again
    (`candidate_scores_torch`) and ranked (`top_groups_of_best_tiles`). On CUDA the Triton scoring kernel
    never writes the scores themselves; elsewhere the torch functions (the specification) compute them.

    Equal to `top_groups` of the scores up to the order of fp32 sums: the tile maxima and the candidates'
    scores come from two kernels, so a near-tie (not an exact one) may resolve differently, as it may
    between the Triton and torch scores."""
    tile = tile or top_set.TOPK_TILE
    args = (q_index, compressed, block_table, token_row, visible_blocks, rows_per_block)
    extra = {} if scales is None else {"scales": scales}
    if use_triton(q_index):
        from .qsa_triton import candidate_scores_triton, index_scores_triton

        maxima = index_scores_triton(*args, max_groups, tile=tile, **extra)
        return top_groups_of_best_tiles(maxima, lambda c: candidate_scores_triton(*args, c, **extra), k, tile)
    maxima = index_tile_maxima_torch(*args, max_groups, tile, **extra)
    return top_groups_of_best_tiles(maxima, lambda c: candidate_scores_torch(*args, c, **extra), k, tile)


# From this many groups a Triton selection writes tile maxima instead of scores (`select_by_tile_maxima`): from
# there on the tile path measured faster on the H200 (benchmarks/check_qsa_kernels.py, RESULTS.md), below it lost.
SELECT_BY_TILES_MIN_GROUPS = 1 << 17


def index_scores_torch(q_index: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                       token_row: torch.Tensor, visible_blocks: torch.Tensor, rows_per_block: int,
                       max_groups: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Index scores ``[N, max_groups]`` float32 of each token over its row's compressed groups.

    q_index ``[N, Hi, Di]``; compressed ``[num_blocks, rows_per_block, Di]``; token ``n`` reads row
    ``token_row[n]`` of ``block_table``. ``score[n, g] = sum_h relu(q_h . k_g) / sqrt(Di)`` for
    ``g < visible_blocks[n]``, ``-inf`` for the others; group ``g`` is compressed row
    ``block_table[row, g // rows_per_block] * rows_per_block + g % rows_per_block``. ``scales``: an fp8 store's
    (`score_and_select`); its keys are widened as read.
    """
    n, num_heads, head_dim = q_index.shape
    device = q_index.device
    groups = torch.arange(max_groups, device=device)
    store = _KeyRows(compressed, scales, head_dim)
    q = q_index.float()
    out = torch.empty(n, max_groups, dtype=torch.float32, device=device)
    single_row = block_table.shape[0] == 1
    if single_row:  # one row: its keys once, then a plain matmul per chunk
        keys = store[paged_rows(block_table, 0, groups, rows_per_block)].float()  # [G, Di]
    step = max(1, _CHUNK_ELEMENTS // max(1, max_groups * max(num_heads, head_dim)))
    for start in range(0, n, step):
        qc = q[start:start + step]
        if single_row:
            scores = torch.einsum("nhd,gd->ngh", qc, keys)
        else:  # each token's row keys, [n, G, Di]
            rows = token_row[start:start + step].long()[:, None]
            keys = store[paged_rows(block_table, rows, groups, rows_per_block)].float()
            scores = torch.einsum("nhd,ngd->ngh", qc, keys)
        out[start:start + step] = scores.relu().sum(-1) / math.sqrt(head_dim)
    return out.masked_fill_(groups[None, :] >= visible_blocks.long()[:, None], float("-inf"))


def index_tile_maxima_torch(q_index: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                            token_row: torch.Tensor, visible_blocks: torch.Tensor, rows_per_block: int,
                            max_groups: int, tile: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, ceil(max_groups / tile)]``: each tile's best index score (`index_scores_torch`, `tile_maxima`)."""
    scores = index_scores_torch(q_index, compressed, block_table, token_row, visible_blocks, rows_per_block,
                                max_groups, scales)
    return tile_maxima(scores, tile)


def candidate_scores_torch(q_index: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                           token_row: torch.Tensor, visible_blocks: torch.Tensor, rows_per_block: int,
                           candidates: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Index scores ``[N, C]`` float32 of the groups ``candidates [N, C]`` of each token (same formula and
    arguments as `index_scores_torch`): ``-inf`` for a group at or past the token's visible count (or
    negative)."""
    n, num_heads, head_dim = q_index.shape
    store = _KeyRows(compressed, scales, head_dim)
    out = torch.empty(candidates.shape, dtype=torch.float32, device=q_index.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, candidates.shape[1] * max(num_heads, head_dim)))
    for start in range(0, n, step):
        groups = candidates[start:start + step].long()
        rows = token_row[start:start + step].long()[:, None]
        keys = store[paged_rows(block_table, rows, groups.clamp_min(0), rows_per_block)].float()  # [n, C, Di]
        scores = torch.einsum("nhd,ncd->nch", q_index[start:start + step].float(), keys)
        live = (groups >= 0) & (groups < visible_blocks[start:start + step].long()[:, None])
        out[start:start + step] = torch.where(live, scores.relu().sum(-1) / math.sqrt(head_dim), float("-inf"))
    return out


class _KeyRows:
    """Rows of a paged store (``[num_blocks, per_block, ...]``) by flat store row, widened to fp32: an fp8 store's
    (``scales`` given) as `fp8.dequantize_fp8` reads them."""

    def __init__(self, store: torch.Tensor, scales: torch.Tensor | None, width: int, dtype=torch.float32):
        self.store = store.view(-1, *store.shape[2:]) if store.dim() > 2 else store.view(-1, width)
        self.scales = None if scales is None else scales.reshape(self.store.shape[:-1])
        self.dtype = dtype

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return self.store[rows].to(self.dtype)
        return dequantize_fp8(self.store[rows], self.scales[rows], self.dtype)


def sparse_paged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_table: torch.Tensor,
                           token_row: torch.Tensor, positions: torch.Tensor, block_size: int,
                           scaling: float, key_scales: torch.Tensor | None = None,
                           value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each query over its selected positions only.

    query ``[N, H, D]``; keys/values ``[num_blocks, block_size, H_kv, D]``; positions ``[N, W]``
    logical positions in the query's row (-1 = unused). Returns ``[N, H, D]``. A query with no
    valid position (a pad) returns zeros. ``key_scales`` / ``value_scales`` ``[num_blocks, block_size, H_kv]``:
    an fp8 store's scales (`fp8`; keys and values are widened to ``query``'s dtype as read, exactly).
    """
    scales = {} if key_scales is None else {"key_scales": key_scales, "value_scales": value_scales}
    if use_triton(query) and not records_grad(query, keys, values):
        from .qsa_triton import sparse_paged_attention_triton

        return sparse_paged_attention_triton(query, keys, values, block_table, token_row, positions, block_size,
                                             scaling, **scales)
    return sparse_paged_attention_torch(query, keys, values, block_table, token_row, positions, block_size, scaling,
                                        **scales)


def sparse_paged_attention_torch(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                 block_table: torch.Tensor, token_row: torch.Tensor, positions: torch.Tensor,
                                 block_size: int, scaling: float, key_scales: torch.Tensor | None = None,
                                 value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """`sparse_paged_attention`'s specification (what the CPU runs)."""
    n, num_heads, head_dim = query.shape
    out = torch.zeros_like(query)
    value_rows = _KeyRows(values, value_scales, head_dim, values.dtype if value_scales is None else query.dtype)
    for start, end, probs, slots in _selected_softmax(query, keys, block_table, token_row, positions, block_size,
                                                       scaling, key_scales):
        v = value_rows[slots]  # [n, W, Hkv, D]
        o = torch.einsum("nkgw,nwkd->nkgd", probs.to(v.dtype), v)
        out[start:end] = o.reshape(-1, num_heads, head_dim)
    return out


def gated_sparse_paged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                 block_table: torch.Tensor, token_row: torch.Tensor, positions: torch.Tensor,
                                 block_size: int, scaling: float, gate: torch.Tensor,
                                 key_scales: torch.Tensor | None = None,
                                 value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """`sparse_paged_attention` times ``sigmoid(gate)`` (``gate`` ``[N, H, D]`` logits), ``[N, H * D]``: the
    attention output rounded to its dtype, the sigmoid rounded alike, their product rounded, as the torch ops
    round. With ``qsa_gate`` on CUDA the gate is applied where the attention's splits are merged."""
    n = query.shape[0]
    scales = {} if key_scales is None else {"key_scales": key_scales, "value_scales": value_scales}
    if (fusions.enabled("qsa_gate") and use_triton(query) and not records_grad(query, keys, values, gate)
            and gate.stride(-1) == 1):
        from .qsa_triton import sparse_paged_attention_triton

        return sparse_paged_attention_triton(query, keys, values, block_table, token_row, positions, block_size,
                                             scaling, gate=gate, **scales)
    out = sparse_paged_attention(query, keys, values, block_table, token_row, positions, block_size, scaling,
                                 **scales)
    return out.reshape(n, -1) * torch.sigmoid(gate).reshape(n, -1)


def sparse_paged_attention_probs(query: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor,
                                 token_row: torch.Tensor, positions: torch.Tensor, block_size: int, scaling: float,
                                 max_len: int, key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The attention probabilities of `sparse_paged_attention` by key position: ``[N, H, max_len]`` in
    ``query``'s dtype, zero at every position a query does not attend (unselected, later, pads; a pad
    query's row is all zeros)."""
    n, num_heads, _ = query.shape
    # One extra column takes the unused (-1) selections, then is dropped.
    out = torch.zeros(n, num_heads, max_len + 1, dtype=torch.float32, device=query.device)
    for start, end, probs, _ in _selected_softmax(query, keys, block_table, token_row, positions, block_size,
                                                  scaling, key_scales):
        pos = positions[start:end].long()
        column = torch.where(pos >= 0, pos, max_len)[:, None, :].expand(-1, num_heads, -1)
        out[start:end].scatter_add_(-1, column, probs.reshape(end - start, num_heads, -1))
    return out[..., :max_len].to(query.dtype)


def _selected_softmax(query: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, token_row: torch.Tensor,
                      positions: torch.Tensor, block_size: int, scaling: float, key_scales: torch.Tensor | None = None):
    """Per chunk of queries: ``(start, end, probs, slots)`` with the fp32 softmax ``probs [n, Hkv, G, W]``
    of each query over its selected positions (0 at unused ones; all 0 for a query with none) and
    their store rows ``slots [n, W]``. What `sparse_paged_attention` and its probabilities share.

    The logits are fp32 from the first product on, as in the Triton kernel (fp32 accumulator) and in
    upstream's default (sdpa) attention: a bf16 einsum would round each logit to bf16, then its scaling."""
    n, num_heads, head_dim = query.shape
    num_kv = keys.shape[2]
    group = num_heads // num_kv
    width = positions.shape[1]
    k_flat = _KeyRows(keys, key_scales, head_dim, keys.dtype if key_scales is None else query.dtype)
    step = max(1, _CHUNK_ELEMENTS // max(1, width * num_kv * head_dim))
    for start in range(0, n, step):
        end = min(n, start + step)
        pos = positions[start:end]
        ok = pos >= 0
        slots = paged_rows(block_table, token_row[start:end, None].long(), pos.clamp_min(0), block_size)
        k = k_flat[slots]  # [n, W, Hkv, D]
        q = query[start:end].view(-1, num_kv, group, head_dim)
        logits = torch.einsum("nkgd,nwkd->nkgw", q.float(), k.float()) * scaling
        logits = logits.masked_fill(~ok[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        yield start, end, torch.nan_to_num(probs, nan=0.0), slots  # rows with nothing to attend (pads)
