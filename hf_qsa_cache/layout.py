"""What state a cache keeps for each layer, and how it is paged: one spec per kind of state.

`build_layout` reads a model's text config and returns a `CacheLayout`: the block tables (`TableSpec`) and,
for every decoder layer, the specs of its stores. Each spec knows the bytes it costs (``page_bytes`` for a
block of its table, ``dense_bytes`` for the state it keeps per row) and builds its store. This module is the one
place that knows the two families' layouts and the default block sizes.

Qwen4Exp (``indexed_attention`` / ``linear_attention`` layers): one ``"main"`` table pages the QSA layers'
K/V and their compressed index keys (a block of ``block_size`` tokens holds ``block_size / ratio``
compressed keys, so the block size is a multiple of the compress ratio); the QSA raw-key ring of the open
group and the GatedDeltaNet / PLE state are dense per row.

Inkling (``hybrid`` / ``hybrid_sliding`` layers), three tables:

* ``"main"``: K/V of the full-attention layers, every position kept;
* ``"sliding"``: K/V of the sliding-window layers. A query at position ``p`` reads keys
  ``p - window + 1 .. p``, so only blocks holding positions ``>= length - window + 1`` stay live;
* ``"conv"``: the inputs of every layer's four short convolutions, ``block_size = conv_kernel_size``; a
  conv at ``p`` reads taps ``p - K + 1 .. p``, older ones from this store.

Windowed tables keep ``num_speculative_tokens`` extra positions so that dropping that many tokens (`crop`)
still finds what the next step reads. They never allocate blocks below the window, not even for positions
a long prefill writes in the same forward (the ops read same-forward keys and taps from the activations),
so a row holds at most ``ceil(window / block_size) + 1`` blocks of each after a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .blocks import BlockTable, default_num_blocks
from .metadata import QSAGeometry
from .ops.fp8 import vector_bytes
from .stores.base import Store
from .stores.inkling import InklingConvStore
from .stores.linear_state import LinearAttentionState
from .stores.paged_kv import PagedKV, SlidingKV
from .stores.qsa_index import QSAIndexStore

QWEN4_LAYER_TYPES = {"indexed_attention", "linear_attention"}
INKLING_LAYER_TYPES = {"hybrid", "hybrid_sliding"}
DEFAULT_BLOCK_SIZE = 64  # tokens per block of the main table (Qwen4Exp: rounded up to the compress ratio)

# Config fields that fix the shape or meaning of cached state, per family. A model drives a cache only if
# all of them agree (`QSAPagedCache.check_model`).
_STATE_FIELDS = {
    "qwen4_exp": (
        "hidden_size", "num_key_value_heads", "head_dim", "indexer_head_dim", "indexer_compress_ratio",
        "linear_conv_kernel_dim", "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
        "linear_value_head_dim", "ple_layer_ids", "ple_conv_kernel_size", "ngram_size", "hc_count", "eos_token_id",
    ),
    "inkling": (
        "hidden_size", "num_key_value_heads", "head_dim", "swa_num_key_value_heads", "swa_head_dim",
        "sliding_window_size", "conv_kernel_size",
    ),
}
_QSA_FIELDS = ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def text_config(config):
    """The decoder's config of a composite (multimodal) config; a text config as is."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return config


def model_family(config) -> str:
    """``"qwen4_exp"`` or ``"inkling"``, from the config's layer types."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    if not layer_types:
        raise ValueError("QSAPagedCache needs a config with `layer_types`")
    kinds = set(layer_types)
    if kinds <= QWEN4_LAYER_TYPES:
        return "qwen4_exp"
    if kinds <= INKLING_LAYER_TYPES:
        return "inkling"
    raise ValueError(f"QSAPagedCache cannot serve layer types {sorted(kinds)}")


def state_geometry(config) -> dict:
    """The config fields that decide how a model's cached state is laid out."""
    family = model_family(config)
    geometry = {"model_family": family, "layer_types": list(config.layer_types)}
    for name in _STATE_FIELDS[family]:
        value = getattr(config, name, None)
        geometry[name] = list(value) if isinstance(value, (list, tuple)) else value
    return geometry


def rollback_costs_nothing(config) -> bool:
    """Whether a cache for this model keeps rollback headroom (``num_speculative_tokens``) at no cost a step:
    Inkling's stores are all addressed by position (a window keeps a position more); Qwen4Exp's keep a copy of
    every GatedDeltaNet and PLE state per token of headroom, written every step (`hf_qsa_cache.rollback`)."""
    return model_family(text_config(config)) == "inkling"


def ring_capacity(ratio: int, num_speculative_tokens: int) -> int:
    """Whole groups covering the open group plus the speculative tokens written before acceptance."""
    span = ratio + num_speculative_tokens
    return ratio * -(-span // ratio)


# ---------------------------------------------------------------------- the specs
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TableSpec:
    """A block table: ``num_blocks`` blocks (the null block included) of ``block_size`` tokens; ``window``:
    only the last ``window`` positions of a row stay live."""

    name: str
    block_size: int
    num_blocks: int
    window: int | None = None

    def build(self, max_rows: int, max_len: int) -> BlockTable:
        return BlockTable(self.name, self.num_blocks, self.block_size, max_rows, max_len, window=self.window)


@dataclass(frozen=True)
class FullAttentionSpec:
    """Paged K/V, every position kept: ``[num_blocks, block_size, kv_heads, head_dim]`` keys and values; with
    ``kv_dtype`` fp8, fp8 values and an fp32 scale per (slot, head) (`hf_qsa_cache.ops.fp8`)."""

    table: str
    block_size: int
    num_blocks: int
    kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype | None = None  # None: the model's dtype

    def page_bytes(self, dtype: torch.dtype) -> int:
        return 2 * self.block_size * self.kv_heads * vector_bytes(self.head_dim, self.kv_dtype, dtype)

    def dense_bytes(self, max_rows: int, dtype: torch.dtype) -> int:
        return 0

    def undo_bytes(self, max_rows: int, dtype: torch.dtype) -> int:
        return 0

    def build(self, max_rows: int) -> Store:
        return PagedKV(self.table, self.num_blocks, self.block_size, self.kv_heads, self.head_dim, self.kv_dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Paged K/V of a sliding-window layer (its table frees blocks that leave the window)."""

    def build(self, max_rows: int) -> Store:
        return SlidingKV(self.table, self.num_blocks, self.block_size, self.kv_heads, self.head_dim, self.kv_dtype)


@dataclass(frozen=True)
class QSAIndexSpec:
    """The QSA indexer's compressed keys (paged on the main table, ``block_size / ratio`` a block; fp8 with a
    scale each under ``index_dtype`` fp8) and its per-row raw-key ring of the open group (keys and their three RoPE
    positions; always in the model's dtype)."""

    table: str
    block_size: int
    num_blocks: int
    compress_ratio: int
    ring_capacity: int
    index_head_dim: int
    index_dtype: torch.dtype | None = None  # None: the model's dtype

    def page_bytes(self, dtype: torch.dtype) -> int:
        return self.block_size // self.compress_ratio * vector_bytes(self.index_head_dim, self.index_dtype, dtype)

    def dense_bytes(self, max_rows: int, dtype: torch.dtype) -> int:
        per_key = self.index_head_dim * _itemsize(dtype) + 3 * 8  # the key, its int64 positions
        return (max_rows + 1) * self.ring_capacity * per_key  # (a spare row takes pads)

    def undo_bytes(self, max_rows: int, dtype: torch.dtype) -> int:
        return self.dense_bytes(max_rows, dtype)  # the ring is overwritten in place

    def build(self, max_rows: int) -> Store:
        return QSAIndexStore(self.table, self.num_blocks, self.block_size, self.compress_ratio, max_rows,
                             self.ring_capacity, self.index_head_dim, self.index_dtype)


@dataclass(frozen=True)
class ConvTapsSpec:
    """Inkling's short-conv inputs (four streams per layer), paged on the conv table (`InklingConvStore`)."""

    table: str
    block_size: int  # = conv kernel size
    num_blocks: int
    kv_heads: int
    head_dim: int
    hidden_size: int

    def page_bytes(self, dtype: torch.dtype) -> int:
        head_width = 2 * self.head_dim + 2 * (self.hidden_size // self.kv_heads)
        return self.block_size * self.kv_heads * head_width * _itemsize(dtype)

    def dense_bytes(self, max_rows: int, dtype: torch.dtype) -> int:
        return 0

    def undo_bytes(self, max_rows: int, dtype: torch.dtype) -> int:
        return 0

    def build(self, max_rows: int) -> Store:
        return InklingConvStore(self.table, self.num_blocks, self.block_size, self.kv_heads, self.head_dim,
                                self.hidden_size)


@dataclass(frozen=True)
class LinearStateSpec:
    """GatedDeltaNet state of a linear-attention layer, dense per row: conv window, fp32 recurrent state;
    on PLE layers the PLE conv window and n-gram context; with ``history`` the rollback rings."""

    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    ple_channels: int = 0
    ple_window: int = 0
    ngram_context: int = 0
    eos_token_id: int = 0
    history: int = 0
    table = None

    def page_bytes(self, dtype: torch.dtype) -> int:
        return 0

    def _row_bytes(self, dtype: torch.dtype) -> int:
        item = _itemsize(dtype)
        return (self.conv_dim * (self.conv_kernel - 1) * item + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4
                + self.ple_channels * self.ple_window * item + self.ngram_context * 8)

    def dense_bytes(self, max_rows: int, dtype: torch.dtype) -> int:
        # live per row; the rollback ring keeps `history` states a row, and a spare row
        return max_rows * self._row_bytes(dtype) + (max_rows + 1) * self.history * self._row_bytes(dtype)

    def undo_bytes(self, max_rows: int, dtype: torch.dtype) -> int:
        return max_rows * self._row_bytes(dtype)  # the live state is overwritten in place

    def build(self, max_rows: int) -> Store:
        return LinearAttentionState(max_rows, self.conv_dim, self.conv_kernel, self.num_v_heads, self.head_k_dim,
                                    self.head_v_dim, self.ple_channels, self.ple_window, self.ngram_context,
                                    self.eos_token_id, self.history)


@dataclass(frozen=True)
class LayerSpec:
    layer_type: str
    stores: dict = field(default_factory=dict)  # store name (the `LayerState` attribute) -> spec


@dataclass(frozen=True)
class CacheLayout:
    family: str
    tables: dict[str, TableSpec]
    layers: list[LayerSpec]
    qsa: QSAGeometry | None  # what the step metadata needs of the QSA stores (None: no QSA layer)

    def bytes_per_block(self, table: str, dtype: torch.dtype) -> int:
        """What one block of ``table`` costs over every layer's stores."""
        return sum(spec.page_bytes(dtype) for layer in self.layers for spec in layer.stores.values()
                   if spec.table == table)

    def dense_bytes(self, max_rows: int, dtype: torch.dtype) -> int:
        """What the state kept per row (not paged) costs over every layer for ``max_rows`` rows."""
        return sum(spec.dense_bytes(max_rows, dtype) for layer in self.layers for spec in layer.stores.values())

    def undo_bytes(self, max_rows: int, dtype: torch.dtype) -> int:
        """What the step's copies of the state overwritten in place cost (`hf_qsa_cache.step.UndoCopies`)."""
        return sum(spec.undo_bytes(max_rows, dtype) for layer in self.layers for spec in layer.stores.values())

    def nbytes(self, max_rows: int, dtype: torch.dtype, step_undo: bool = True) -> int:
        """What a cache allocates (the token log excluded): every layer's whole pools and per-row state, and with
        ``step_undo`` the step's undo copies."""
        paged = sum(self.bytes_per_block(name, dtype) * table.num_blocks for name, table in self.tables.items())
        return paged + self.dense_bytes(max_rows, dtype) + (self.undo_bytes(max_rows, dtype) if step_undo else 0)

    def bytes_per_token(self, table: str, dtype: torch.dtype) -> float:
        """What one more token of a row costs on ``table`` over every layer (fp8 scales included)."""
        return self.bytes_per_block(table, dtype) / self.tables[table].block_size


# ---------------------------------------------------------------------- the families
def build_layout(config, max_rows: int, max_len: int, block_size: int | None = None, num_blocks: int | None = None,
                 num_speculative_tokens: int = 0, kv_cache_dtype: torch.dtype | None = None,
                 index_cache_dtype: torch.dtype | None = None) -> CacheLayout:
    """The layout of a cache for ``config`` (a text config) holding ``max_rows`` rows of ``max_len`` tokens.
    ``block_size`` and ``num_blocks`` size the main table (default: every row at ``max_len``).
    ``kv_cache_dtype``: the paged attention K/V's storage (None: the model's dtype; fp8: `hf_qsa_cache.ops.fp8`);
    ``index_cache_dtype``: the QSA compressed keys' (Qwen4Exp)."""
    family = model_family(config)
    if family == "qwen4_exp":
        return _qwen4_exp_layout(config, max_rows, max_len, block_size, num_blocks, num_speculative_tokens,
                                 kv_cache_dtype, index_cache_dtype)
    return _inkling_layout(config, max_rows, max_len, block_size, num_blocks, num_speculative_tokens, kv_cache_dtype)


def _qwen4_exp_layout(config, max_rows, max_len, block_size, num_blocks, spec_tokens, kv_dtype=None,
                      index_dtype=None) -> CacheLayout:
    layer_types = list(config.layer_types)
    has_qsa = "indexed_attention" in layer_types
    if has_qsa and any(getattr(config, f, None) in (None, 0) for f in _QSA_FIELDS):
        raise ValueError(f"a config with indexed_attention layers needs {', '.join(_QSA_FIELDS)} set")
    ratio = config.indexer_compress_ratio if has_qsa else 1
    if block_size is None:
        block_size = ratio * -(-DEFAULT_BLOCK_SIZE // ratio)
    if block_size % ratio != 0:
        raise ValueError(f"block_size must be a multiple of indexer_compress_ratio={ratio}, got block_size={block_size}")
    if num_blocks is None:
        num_blocks = default_num_blocks(max_rows, block_size, max_len)
    qsa = QSAGeometry(compress_ratio=ratio, ring_capacity=ring_capacity(ratio, spec_tokens)) if has_qsa else None

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ple_ids = set(getattr(config, "ple_layer_ids", None) or [])
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    layers = []
    for i, kind in enumerate(layer_types):
        if kind == "indexed_attention":
            layers.append(LayerSpec(kind, {
                "kv": FullAttentionSpec("main", block_size, num_blocks, config.num_key_value_heads, head_dim,
                                        kv_dtype),
                "index": QSAIndexSpec("main", block_size, num_blocks, ratio, qsa.ring_capacity,
                                      config.indexer_head_dim, index_dtype),
            }))
            continue
        key_dim = config.linear_key_head_dim * config.linear_num_key_heads
        value_dim = config.linear_value_head_dim * config.linear_num_value_heads
        ple = (i + 1) in ple_ids
        layers.append(LayerSpec(kind, {"linear": LinearStateSpec(
            conv_dim=2 * key_dim + value_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            num_v_heads=config.linear_num_value_heads,
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            ple_channels=config.hc_count * config.hidden_size if ple else 0,
            ple_window=(config.ple_conv_kernel_size - 1) * config.ngram_size if ple else 0,
            ngram_context=config.ngram_size - 1 if ple else 0,
            eos_token_id=eos if eos is not None else 0,
            history=spec_tokens + 1 if spec_tokens else 0,
        )}))
    tables = {"main": TableSpec("main", block_size, num_blocks)}
    return CacheLayout("qwen4_exp", tables, layers, qsa)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _inkling_heads(config, layer_type: str) -> tuple[int, int]:
    if layer_type == "hybrid_sliding":
        return config.swa_num_key_value_heads, config.swa_head_dim
    return config.num_key_value_heads, config.head_dim


def _check_inkling_config(config) -> None:
    """Reject geometries the paged stores cannot represent (before anything is built)."""
    kernel = getattr(config, "conv_kernel_size", None)
    if not isinstance(kernel, int) or kernel < 1:
        raise ValueError(f"conv_kernel_size must be an integer >= 1, got {kernel!r}")
    if "hybrid_sliding" in config.layer_types:
        window = getattr(config, "sliding_window_size", None)
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window_size must be an integer >= 1, got {window!r}")
    for i, kind in enumerate(config.layer_types):
        heads, _ = _inkling_heads(config, kind)
        if config.hidden_size % heads != 0:
            raise ValueError(f"layer {i}: the conv store packs hidden_size={config.hidden_size} over {heads} KV "
                             f"heads, which does not divide it")


def _inkling_layout(config, max_rows, max_len, block_size, num_blocks, spec_tokens, kv_dtype=None) -> CacheLayout:
    """``block_size`` and ``num_blocks`` size the main (full-attention) table; the sliding table uses the same
    block size when given (default: the window rounded up to a power of two, at most `DEFAULT_BLOCK_SIZE`),
    and the windowed tables are sized from their per-row bound, so they never run out."""
    _check_inkling_config(config)
    main_bs = block_size or DEFAULT_BLOCK_SIZE
    if num_blocks is None:
        num_blocks = default_num_blocks(max_rows, main_bs, max_len)
    tables = {"main": TableSpec("main", main_bs, num_blocks)}

    def windowed(name: str, bs: int, window: int) -> TableSpec:
        return TableSpec(name, bs, default_num_blocks(max_rows, bs, max_len, window), window)

    if "hybrid_sliding" in config.layer_types:
        window = config.sliding_window_size + spec_tokens
        tables["sliding"] = windowed("sliding", block_size or min(DEFAULT_BLOCK_SIZE, _next_pow2(window)), window)
    kernel = config.conv_kernel_size
    conv = tables["conv"] = windowed("conv", kernel, kernel + spec_tokens)

    layers = []
    for kind in config.layer_types:
        heads, head_dim = _inkling_heads(config, kind)
        if kind == "hybrid_sliding":
            t = tables["sliding"]
            kv = SlidingWindowSpec("sliding", t.block_size, t.num_blocks, heads, head_dim, kv_dtype)
        else:
            kv = FullAttentionSpec("main", main_bs, num_blocks, heads, head_dim, kv_dtype)
        taps = ConvTapsSpec("conv", kernel, conv.num_blocks, heads, head_dim, config.hidden_size)
        layers.append(LayerSpec(kind, {"kv": kv, "conv": taps}))
    return CacheLayout("inkling", tables, layers, qsa=None)
