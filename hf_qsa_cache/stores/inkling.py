"""Inkling state: paged attention K/V (full and sliding) and the paged short-conv window.

Three block tables serve an Inkling model:

* ``"main"``: K/V of the full-attention (``hybrid``) layers, every position kept.
* ``"sliding"``: K/V of the sliding-window (``hybrid_sliding``) layers. A query at position ``p``
  reads keys ``p - window + 1 .. p``, so after a forward only blocks holding positions
  ``>= length - window + 1`` stay live; older ones go back to the pool.
* ``"conv"``: the inputs of the four short convolutions of every layer, ``block_size = window =
  conv_kernel_size``. A conv at position ``p`` reads taps ``p - K + 1 .. p``; taps of this forward
  come from its input, older ones from this store, so only the last ``K - 1`` positions matter.

Windowed tables keep ``num_speculative_tokens`` extra positions so that dropping that many tokens
(`QSAPagedCache.crop`, speculative decoding) still finds the taps and keys the next step reads.

Windowed tables never allocate blocks below the window, not even for positions a long prefill
writes in the same forward: the attention and conv ops read same-forward keys and taps from the
activations, never from the store, so such positions are written into the null block (block 0,
which is never read). A row therefore holds at most ``ceil(window / block_size) + 1`` blocks of
each windowed table after a step, and at most twice that while a step is in flight, however long
its prompt or its generation.

Conv layout, per layer: ``[num_blocks, K, H, D]`` with ``H`` the layer's KV heads and the four
streams packed per head along ``D = 2 * head_dim + 2 * hidden / H`` (K, V, attention-output chunk,
MLP-output chunk). Flat channel ``c`` of a stream of width ``w`` per head lives at head ``c // w``.
"""

from __future__ import annotations

import torch

from ..blocks import BlockTable, default_num_blocks
from .layer_state import LayerState
from .paged_kv import PagedKV, grown_pool

STREAM_K, STREAM_V, STREAM_ATTN, STREAM_MLP = 0, 1, 2, 3
DEFAULT_BLOCK_SIZE = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class SlidingKV(PagedKV):
    """Paged K/V of sliding-window layers (reported apart from the full layers' K/V)."""

    def nbytes(self) -> dict[str, int]:
        return {"sliding_kv": sum(t.numel() * t.element_size() for t in self.paged_tensors())}


class InklingConvStore:
    """Inputs of one layer's four short convolutions, paged by logical position."""

    def __init__(self, table: str, num_blocks: int, kernel_size: int, num_heads: int, head_dim: int,
                 hidden_size: int):
        self.table = table
        self.num_blocks = num_blocks
        self.kernel_size = kernel_size
        self.num_heads = num_heads
        chunk = hidden_size // num_heads
        self.widths = (head_dim, head_dim, chunk, chunk)  # per head: K, V, attention out, MLP out
        self.offsets = tuple(sum(self.widths[:i]) for i in range(4))
        self.head_width = sum(self.widths)
        self.state: torch.Tensor | None = None  # [num_blocks, K, H, D], model dtype

    @property
    def allocated(self) -> bool:
        return self.state is not None

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.state is None else self.state.dtype

    def allocate(self, device, dtype) -> None:
        shape = (self.num_blocks, self.kernel_size, self.num_heads, self.head_width)
        self.state = torch.zeros(shape, device=device, dtype=dtype)

    def deallocate(self) -> None:
        self.state = None

    def resize_blocks(self, num_blocks: int) -> None:
        """Grow the pool to ``num_blocks`` blocks, keeping what the held ones hold."""
        if self.state is not None and num_blocks > self.num_blocks:
            self.state = grown_pool(self.state, num_blocks)
        self.num_blocks = max(num_blocks, self.num_blocks)

    def stream(self, idx: int) -> torch.Tensor:
        """``[num_blocks * K, H, width]`` view of one stream; row ``s`` is slot ``s``."""
        flat = self.state.view(-1, self.num_heads, self.head_width)
        off = self.offsets[idx]
        return flat[:, :, off: off + self.widths[idx]]

    def paged_tensors(self) -> list[torch.Tensor]:
        return [self.state] if self.state is not None else []

    def row_tensors(self) -> list[torch.Tensor]:
        return []

    def inplace_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []  # paged by position: a step writes only past its rows' lengths

    def reset(self) -> None:
        pass  # taps are read only for positions a row wrote; the tables decide what is live

    def nbytes(self) -> dict[str, int]:
        return {"inkling_conv": 0 if self.state is None else self.state.numel() * self.state.element_size()}


def _layer_geometry(config, layer_type: str) -> tuple[int, int]:
    if layer_type == "hybrid_sliding":
        return config.swa_num_key_value_heads, config.swa_head_dim
    return config.num_key_value_heads, config.head_dim


def validate_inkling_config(config, block_size: int | None) -> None:
    """Reject geometries the paged stores cannot represent (before anything is built)."""
    kernel = getattr(config, "conv_kernel_size", None)
    if not isinstance(kernel, int) or kernel < 1:
        raise ValueError(f"conv_kernel_size must be an integer >= 1, got {kernel!r}")
    layer_types = config.layer_types
    if "hybrid_sliding" in layer_types:
        window = getattr(config, "sliding_window_size", None)
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window_size must be an integer >= 1, got {window!r}")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for i, kind in enumerate(layer_types):
        heads, _ = _layer_geometry(config, kind)
        if config.hidden_size % heads != 0:
            raise ValueError(
                f"layer {i}: the conv store packs hidden_size={config.hidden_size} over {heads} KV heads, "
                f"which does not divide it"
            )


def build_inkling_layers(cache, config, block_size: int | None, num_blocks: int | None):
    """Stores and block tables of an Inkling `QSAPagedCache`.

    ``block_size`` and ``num_blocks`` size the ``"main"`` (full-attention) pool; the sliding pool
    uses the same block size when given (default: the window rounded up to a power of two, at most
    64), and the windowed pools are sized from their per-row bound, so they never run out.
    """
    validate_inkling_config(config, block_size)
    rows = cache.max_batch_size
    spec = cache.num_speculative_tokens
    kernel = config.conv_kernel_size

    main_bs = block_size or DEFAULT_BLOCK_SIZE
    if num_blocks is None:
        num_blocks = default_num_blocks(rows, main_bs, cache.max_cache_len)
    tables: dict[str, BlockTable] = {"main": BlockTable("main", num_blocks, main_bs, rows, cache.max_cache_len)}

    def windowed(name: str, bs: int, window: int) -> BlockTable:
        num = default_num_blocks(rows, bs, cache.max_cache_len, window)
        return BlockTable(name, num, bs, rows, cache.max_cache_len, window=window)

    has_sliding = "hybrid_sliding" in config.layer_types
    if has_sliding:
        window = config.sliding_window_size + spec
        sliding_bs = block_size or min(DEFAULT_BLOCK_SIZE, _next_pow2(window))
        tables["sliding"] = windowed("sliding", sliding_bs, window)
    tables["conv"] = windowed("conv", kernel, kernel + spec)

    layers = []
    for kind in config.layer_types:
        heads, head_dim = _layer_geometry(config, kind)
        if kind == "hybrid_sliding":
            t = tables["sliding"]
            kv = SlidingKV("sliding", t.num_blocks, t.block_size, heads, head_dim)
        else:
            kv = PagedKV("main", num_blocks, main_bs, heads, head_dim)
        conv = InklingConvStore("conv", tables["conv"].num_blocks, kernel, heads, head_dim, config.hidden_size)
        layers.append(LayerState(kind, kv=kv, conv=conv))
    return layers, tables


__all__ = ["build_inkling_layers", "InklingConvStore", "SlidingKV",
           "STREAM_K", "STREAM_V", "STREAM_ATTN", "STREAM_MLP"]
