"""QSA ops, torch reference (the specification; runs on CPU and GPU).

Tokens are the flattened ``[B*L]`` rows of a forward, described by `StepMetadata`. Compressed group
``g`` of a row covers logical positions ``g*r .. g*r+r-1``; a query at position ``p`` may score its
row's groups ``0 .. visible_blocks-1``, keeps the ``budget / r`` best, and always attends the
open-group tail ``((p+1)//r)*r .. p``.
"""

from __future__ import annotations

import math

import torch

from ..metadata import StepMetadata

# Upper bound on the float elements one chunk of scores / gathered K/V may take.
_CHUNK_ELEMENTS = 1 << 26


def paged_rows(block_table: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """Flat store row of logical item ``index`` (token or compressed group) of cache row ``rows``."""
    block = block_table[rows, (index // rows_per_block).clamp_max(block_table.shape[1] - 1)].long()
    return block * rows_per_block + index % rows_per_block


def gather_group_raw_keys(meta: StepMetadata, work: torch.Tensor, ratio: int, ring_keys: torch.Tensor,
                          ring_positions: torch.Tensor, capacity: int, raw_keys: torch.Tensor,
                          positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw keys ``[W, r, Di]`` of each work group, and the 3-axis position ``[W, 3]`` of its first token.

    A group's tokens from this forward come from ``raw_keys``/``positions`` (``[B*L, ...]``); earlier
    ones from the row's ring, which still holds them because the group was open.
    """
    row = work[:, 0].long().clamp_min(0)
    group = work[:, 1].long().clamp_min(0)
    pos = group[:, None] * ratio + torch.arange(ratio, device=work.device)  # [W, r]
    prev = meta.prev_len.long()[row][:, None]
    count = meta.count.long()[row][:, None]
    L = meta.query_len
    in_chunk = pos >= prev
    chunk_token = row[:, None] * L + (L - count) + (pos - prev)
    ring_row = row[:, None] * capacity + pos % capacity
    chunk_token = chunk_token.clamp(0, raw_keys.shape[0] - 1)
    keys = torch.where(in_chunk[..., None], raw_keys[chunk_token], ring_keys[ring_row].to(raw_keys.dtype))
    first_pos = torch.where(in_chunk[:, :1], positions[chunk_token[:, 0]], ring_positions[ring_row[:, 0]])
    return keys, first_pos


def score_and_select(q_index: torch.Tensor, compressed: torch.Tensor, meta: StepMetadata, table: str,
                     block_size: int, ratio: int, block_topk: int) -> torch.Tensor:
    """Selected token positions ``[B*L, block_topk*r + r - 1]`` (-1 = unused), selected blocks first.

    q_index: ``[B*L, Hi, Di]`` normed and rotated index queries; compressed: ``[num_blocks, block_size/r, Di]``.
    Score of group b: ``sum_h relu(q_h . k_b) / sqrt(Di)``, top ``min(block_topk, visible)`` kept;
    among equal scores the lower group index wins (upstream leaves ties to ``torch.topk``).
    """
    n, num_heads, head_dim = q_index.shape
    device = q_index.device
    B, L = meta.num_rows, meta.query_len
    rows_per_block = block_size // ratio
    max_groups = max((s // ratio for s in meta.host_seq_len), default=0)
    width = block_topk * ratio + ratio - 1
    pos = meta.position
    safe_pos = pos.clamp_min(0)

    # Open-group tail: ((p+1)//r)*r .. p, at most r-1 tokens.
    tail_start = ((safe_pos + 1) // ratio) * ratio
    tail = tail_start[:, None] + torch.arange(ratio - 1, device=device)
    tail = torch.where((tail <= pos[:, None]) & (pos[:, None] >= 0), tail, -1)
    if max_groups == 0:
        selected = torch.full((n, block_topk * ratio), -1, dtype=torch.long, device=device)
        return torch.cat([selected, tail], dim=1)

    # Each row's compressed keys, [B, G, Di].
    groups = torch.arange(max_groups, device=device)
    table_t = meta.block_tables[table]
    rows = torch.arange(B, device=device)
    flat = paged_rows(table_t, rows[:, None], groups[None, :], rows_per_block)
    keys = compressed.view(-1, head_dim)[flat].float()

    k = min(block_topk, max_groups)
    q = q_index.view(B, L, num_heads, head_dim).float()
    visible = meta.visible_blocks.view(B, L).long()
    chosen = []
    step = max(1, _CHUNK_ELEMENTS // max(1, B * num_heads * max_groups))
    for start in range(0, L, step):
        qc = q[:, start:start + step]
        scores = torch.einsum("blhd,bgd->blgh", qc, keys).relu().sum(-1) / math.sqrt(head_dim)
        vis = visible[:, start:start + step]
        scores = scores.masked_fill(groups[None, None, :] >= vis[..., None], float("-inf"))
        # Ties (relu makes exact zeros common) go to the lower group index: a stable, documented rule.
        idx = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]  # [B, l, k]
        idx = torch.where(idx < vis[..., None], idx, -1)
        chosen.append(idx)
    blocks = torch.cat(chosen, dim=1).reshape(n, k)
    tokens = blocks[:, :, None] * ratio + torch.arange(ratio, device=device)
    tokens = torch.where(blocks[:, :, None] >= 0, tokens, -1).reshape(n, k * ratio)
    pad = torch.full((n, (block_topk - k) * ratio), -1, dtype=torch.long, device=device)
    return torch.cat([tokens, pad, tail], dim=1)


def sparse_paged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_table: torch.Tensor,
                           token_row: torch.Tensor, positions: torch.Tensor, block_size: int,
                           scaling: float) -> torch.Tensor:
    """Attention of each query over its selected positions only.

    query ``[N, H, D]``; keys/values ``[num_blocks, block_size, H_kv, D]``; positions ``[N, W]``
    logical positions in the query's row (-1 = unused). Returns ``[N, H, D]``. A query with no
    valid position (a pad) returns zeros.
    """
    n, num_heads, head_dim = query.shape
    num_kv = keys.shape[2]
    group = num_heads // num_kv
    width = positions.shape[1]
    out = torch.zeros_like(query)
    k_flat = keys.view(-1, num_kv, head_dim)
    v_flat = values.view(-1, num_kv, head_dim)
    step = max(1, _CHUNK_ELEMENTS // max(1, width * num_kv * head_dim))
    for start in range(0, n, step):
        pos = positions[start:start + step]
        ok = pos >= 0
        slots = paged_rows(block_table, token_row[start:start + step, None].long(), pos.clamp_min(0), block_size)
        k = k_flat[slots]  # [n, W, Hkv, D]
        v = v_flat[slots]
        q = query[start:start + step].view(-1, num_kv, group, head_dim)
        logits = torch.einsum("nkgd,nwkd->nkgw", q, k) * scaling
        logits = logits.masked_fill(~ok[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0).to(v.dtype)  # rows with nothing to attend (pads)
        o = torch.einsum("nkgw,nwkd->nkgd", probs, v)
        out[start:start + step] = o.reshape(-1, num_heads, head_dim)
    return out
