"""`QSAPagedCache`: paged, per-row state for Qwen4Exp and Inkling under transformers `generate()`.

Where each state lives:

* ``self.tables``: one `BlockTable` per block geometry. ``"main"`` pages full-length attention K/V
  and the QSA compressed keys; Inkling adds ``"sliding"`` (window K/V) and ``"conv"`` (short-conv
  inputs). Tables hold host-side bookkeeping only.
* ``self.layers[i]``: a `LayerState` whose stores hold layer ``i``'s tensors (allocated on first
  write, on the device and in the dtype of that layer's activations, so a model split across GPUs
  keeps each layer's state beside it).
* ``self.lengths``: each row's logical length (real tokens, pads excluded).

A forward starts with `begin_step`, which validates the input, reserves blocks and builds one
`StepMetadata` that every layer reads (`step_metadata(device)`).
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import Cache

from .blocks import NULL_BLOCK, BlockTable
from .metadata import QSAGeometry, StepMetadata, build_step_metadata
from .speculative import check_linear_rollback, restore_linear_states
from .stores.linear_state import LinearAttentionState
from .stores.paged_kv import PagedKV
from .stores.qsa_index import QSAIndexStore, ring_capacity

QWEN4_LAYER_TYPES = {"indexed_attention", "linear_attention"}
INKLING_LAYER_TYPES = {"hybrid", "hybrid_sliding"}


class LayerState:
    """The stores of one decoder layer (attribute names say what they hold)."""

    def __init__(self, layer_type: str, **stores):
        self.layer_type = layer_type
        self.stores = stores
        for name, store in stores.items():
            setattr(self, name, store)

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == "hybrid_sliding"

    def __repr__(self):
        return f"LayerState({self.layer_type}, {sorted(self.stores)})"


def _canonical(device) -> torch.device:
    """``cuda`` and ``cuda:<current>`` name the same device; key per-device copies by one name."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _text_config(config):
    if hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return config


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


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


# Config fields that fix the shape or meaning of cached state, per family. A model drives a cache
# only if all of them agree (`QSAPagedCache.check_model`).
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


def state_geometry(config) -> dict:
    """The config fields that decide how a model's cached state is laid out."""
    family = model_family(config)
    geometry = {"model_family": family, "layer_types": list(config.layer_types)}
    for name in _STATE_FIELDS[family]:
        value = getattr(config, name, None)
        geometry[name] = list(value) if isinstance(value, (list, tuple)) else value
    return geometry


class QSAPagedCache(Cache):
    """Paged cache for `modeling.Qwen4ExpForCausalLM` and `modeling.InklingForCausalLM`.

    Args:
        config: the model's text config (`Qwen4ExpTextConfig` or `InklingTextConfig`; a composite
            config is reduced to its text config).
        max_batch_size: most rows (sequences, beams included) one batch may have.
        max_cache_len: most tokens one row may hold (pads do not count).
        block_size: tokens per block of the main table (default 64, rounded up to a multiple of the
            QSA compress ratio, which it must be a multiple of).
        num_blocks: blocks in the main pool (default: every row at ``max_cache_len``, plus the null block).
        num_speculative_tokens: draft tokens a step may write before acceptance: how many tokens `crop` can
            take back (ring and window headroom; on Qwen4Exp also the per-position GatedDeltaNet / PLE
            state kept for rollback, reported as ``"rollback_headroom"`` by `memory_stats`).
        device, dtype: allocate every store there up front; by default each layer's stores are
            allocated at its first forward, on its device and in its dtype.
    """

    def __init__(
        self,
        config,
        max_batch_size: int,
        max_cache_len: int,
        block_size: int | None = None,
        num_blocks: int | None = None,
        num_speculative_tokens: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        config = _text_config(config)
        self.model_family = model_family(config)
        layer_types = list(config.layer_types)
        _check_int("max_batch_size", max_batch_size, 1)
        _check_int("max_cache_len", max_cache_len, 1)
        _check_int("num_speculative_tokens", num_speculative_tokens, 0)
        if block_size is not None:
            _check_int("block_size", block_size, 1)
        if num_blocks is not None:
            _check_int("num_blocks", num_blocks, 2)
        if (device is None) != (dtype is None):
            raise ValueError(
                f"pass device and dtype together (every store allocated up front) or neither (each layer's stores "
                f"allocated at its first forward, beside it), got device={device}, dtype={dtype}"
            )
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch.dtype (the model's), got {dtype!r}")

        self.config = config
        self.layer_types = layer_types
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.num_speculative_tokens = num_speculative_tokens
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype

        self.qsa: QSAGeometry | None = None
        if self.model_family == "qwen4_exp":
            layers, self.tables = self._build_qwen4_exp(config, block_size, num_blocks)
        else:
            from .stores.inkling import build_inkling_layers

            layers, self.tables = build_inkling_layers(self, config, block_size, num_blocks)
        super().__init__(layers=layers)

        self.geometry = state_geometry(config)  # what a model must match to drive this cache
        self.lengths = [0] * max_batch_size
        self._crop_floor = [0] * max_batch_size  # Qwen4Exp: shortest length a crop may reach (speculative.py)
        self.num_rows = 0  # rows of the batch in flight
        self.columns_seen = 0  # rectangular length (pads included) that generate() reasons in
        self._step: StepMetadata | None = None
        self._step_by_device: dict[torch.device, StepMetadata] = {}
        self._undo: tuple | None = None  # host state before the step in flight
        self._checked_model: tuple | None = None  # (config, dtype) last accepted by check_model
        self._unusable: str | None = None  # why the cache must be reset() before further use
        # Stores that one step overwrites in place (recurrent state, the QSA ring) cannot be rolled back.
        self._exact_rollback = all(
            store.rollback_safe for layer in layers for store in layer.stores.values()
        )
        if self.device is not None and self.dtype is not None:
            for layer in self.layers:
                for store in layer.stores.values():
                    store.allocate(self.device, self.dtype)

    # ------------------------------------------------------------------ construction
    def _build_qwen4_exp(self, config, block_size, num_blocks):
        fields = ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
        has_qsa = "indexed_attention" in self.layer_types
        if has_qsa and any(getattr(config, f, None) in (None, 0) for f in fields):
            raise ValueError(f"a config with indexed_attention layers needs {', '.join(fields)} set")
        ratio = config.indexer_compress_ratio if has_qsa else 1
        if block_size is None:
            block_size = ratio * -(-64 // ratio)
        if block_size % ratio != 0:
            raise ValueError(
                f"block_size must be a multiple of indexer_compress_ratio={ratio}, got block_size={block_size}"
            )
        blocks_per_row = -(-self.max_cache_len // block_size)
        if num_blocks is None:
            num_blocks = self.max_batch_size * blocks_per_row + 1
        tables = {"main": BlockTable("main", num_blocks, block_size, self.max_batch_size, self.max_cache_len)}
        if has_qsa:
            cap = ring_capacity(ratio, self.num_speculative_tokens)
            self.qsa = QSAGeometry(compress_ratio=ratio, ring_capacity=cap, table="main")

        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        ple_ids = set(getattr(config, "ple_layer_ids", None) or [])
        layers = []
        for i, kind in enumerate(self.layer_types):
            if kind == "indexed_attention":
                layers.append(LayerState(
                    kind,
                    kv=PagedKV("main", num_blocks, block_size, config.num_key_value_heads, head_dim),
                    index=QSAIndexStore("main", num_blocks, block_size, ratio, self.max_batch_size,
                                        self.qsa.ring_capacity, config.indexer_head_dim),
                ))
            else:
                key_dim = config.linear_key_head_dim * config.linear_num_key_heads
                value_dim = config.linear_value_head_dim * config.linear_num_value_heads
                ple = (i + 1) in ple_ids
                eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
                layers.append(LayerState(kind, linear=LinearAttentionState(
                    self.max_batch_size,
                    conv_dim=2 * key_dim + value_dim,
                    conv_kernel=config.linear_conv_kernel_dim,
                    num_v_heads=config.linear_num_value_heads,
                    head_k_dim=config.linear_key_head_dim,
                    head_v_dim=config.linear_value_head_dim,
                    ple_channels=config.hc_count * config.hidden_size if ple else 0,
                    ple_window=(config.ple_conv_kernel_size - 1) * config.ngram_size if ple else 0,
                    ngram_context=config.ngram_size - 1 if ple else 0,
                    eos_token_id=eos if eos is not None else 0,
                    history=self.num_speculative_tokens + 1 if self.num_speculative_tokens else 0,
                )))
        return layers, tables

    # ------------------------------------------------------------------ the step
    def _row_counts(self, batch_size: int, query_len: int, attention_mask: torch.Tensor | None) -> list[int]:
        """Real tokens per row in this forward, validating that the mask is left-padded."""
        starting = any(self.lengths[b] == 0 for b in range(batch_size))
        if attention_mask is None:
            return [query_len] * batch_size
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
            raise ValueError(
                f"attention_mask must be 2-D [batch, length] with batch {batch_size}, got {tuple(attention_mask.shape)}"
            )
        if attention_mask.shape[1] < query_len:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[1]} columns, fewer than the {query_len} input tokens"
            )
        if query_len == 1 and not starting:
            # generate() appends a 1 for every row at every step; trusting it keeps decode free of host syncs.
            return [1] * batch_size
        mask = attention_mask.detach().to("cpu", torch.int64)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 and 1")
        steps = mask[:, 1:] - mask[:, :-1]
        bad = (steps < 0).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"attention_mask is not left-padded: row {bad[0]} has a real token before a pad "
                "(use tokenizer.padding_side='left')"
            )
        counts = mask[:, -query_len:].sum(dim=1).tolist()
        for b, c in enumerate(counts):
            if self.lengths[b] > 0 and c != query_len:
                raise ValueError(
                    f"attention_mask is not left-padded: row {b} already holds {self.lengths[b]} tokens "
                    f"but has {query_len - c} pads in this step"
                )
        return counts

    def check_step(self, batch_size: int, query_len: int, attention_mask: torch.Tensor | None) -> list[int]:
        """Validate a forward of ``[batch_size, query_len]`` tokens without changing anything.

        Returns the real-token count of each row. Models that split a long prompt into chunks call
        this first for the whole prompt, so a bad prompt is rejected before any chunk lands.
        """
        if self._unusable is not None:
            raise ValueError(self._unusable)
        if batch_size > self.max_batch_size:
            raise ValueError(f"batch of {batch_size} rows exceeds max_batch_size={self.max_batch_size}")
        if self.columns_seen > 0 and batch_size != self.num_rows:
            raise ValueError(
                f"the cache holds a batch of {self.num_rows} rows in flight, got {batch_size}; call reset() first"
            )
        counts = self._row_counts(batch_size, query_len, attention_mask)
        self._check_fits([self.lengths[b] + counts[b] for b in range(batch_size)])
        return counts

    def _check_fits(self, new_lengths: list[int], what: str = "this step") -> None:
        """Raise unless rows growing to ``new_lengths`` fit ``max_cache_len`` and every block pool."""
        for b, need in enumerate(new_lengths):
            if need > self.max_cache_len:
                raise ValueError(f"row {b} needs {need} slots, cache holds max_cache_len={self.max_cache_len}")
        for name, table in self.tables.items():
            need = sum(table.blocks_needed(b, n) for b, n in enumerate(new_lengths))
            if need > len(table.free):
                raise ValueError(
                    f"{name} block pool: {what} needs {need} free blocks of {table.block_size} tokens, "
                    f"{len(table.free)} are free (num_blocks={table.num_blocks})"
                )

    def check_request(self, prompt_lengths: list[int], max_new_tokens: int) -> None:
        """Raise before any forward unless rows of ``prompt_lengths`` real tokens can each add
        ``max_new_tokens`` more (what `generate()` checks before its prefill)."""
        if self._unusable is not None:
            raise ValueError(self._unusable)
        if len(prompt_lengths) > self.max_batch_size:
            raise ValueError(f"batch of {len(prompt_lengths)} rows exceeds max_batch_size={self.max_batch_size}")
        for b, n in enumerate(prompt_lengths):
            if n == 0:
                raise ValueError(f"row {b} of attention_mask has no real token (all zeros): nothing to generate from")
            if n + max_new_tokens > self.max_cache_len:
                raise ValueError(
                    f"row {b} needs {n + max_new_tokens} slots ({n} prompt tokens + max_new_tokens={max_new_tokens}), "
                    f"cache holds max_cache_len={self.max_cache_len}"
                )
        self._check_fits([max(self.lengths[b], n + max_new_tokens) for b, n in enumerate(prompt_lengths)],
                         what="this generate() call")

    def check_model(self, config, dtype: torch.dtype) -> None:
        """Raise unless a model of ``config`` running in ``dtype`` lays out its state as this cache does.

        Checked once per (model config, dtype), before the first step changes anything.
        """
        if self._checked_model is not None and self._checked_model[0] is config and self._checked_model[1] == dtype:
            return
        theirs = state_geometry(_text_config(config))
        for field in dict.fromkeys([*self.geometry, *theirs]):
            mine, other = self.geometry.get(field), theirs.get(field)
            if mine != other:
                raise ValueError(f"the cache was built for {field}={mine!r}, the model has {field}={other!r}")
        held = self.dtype or self._allocated_dtype()
        if held is not None and held != dtype:
            raise ValueError(
                f"the cache holds state in dtype={held}, the model runs in dtype={dtype}: build the cache with "
                f"dtype={dtype} (or without device/dtype, to follow the model)"
            )
        self._checked_model = (config, dtype)

    def _allocated_dtype(self) -> torch.dtype | None:
        for layer in self.layers:
            for store in layer.stores.values():
                if store.allocated:
                    return store.dtype
        return None

    def begin_step(self, batch_size: int, query_len: int, attention_mask: torch.Tensor | None,
                   device: torch.device) -> StepMetadata:
        """Validate, reserve blocks and build this forward's metadata. Nothing changes on error.

        The step stays open until `commit_step` (it landed) or `abort_step` (a layer raised); `step()`
        pairs them.
        """
        prev, counts = self.accept_step(batch_size, query_len, attention_mask)
        device = _canonical(device)
        lengths = torch.tensor([prev, counts], dtype=torch.int32)  # one host-to-device copy per step
        if device.type == "cuda":
            lengths = lengths.to(device, non_blocking=True)
        block_tables = {name: t.device_table(batch_size, device) for name, t in self.tables.items()}
        block_sizes = {name: t.block_size for name, t in self.tables.items()}
        meta = build_step_metadata(lengths[0], lengths[1], query_len, block_tables, block_sizes, self.qsa,
                                   prev, counts)
        self.set_step_metadata(meta, device)
        return meta

    def accept_step(self, batch_size: int, query_len: int,
                    attention_mask: torch.Tensor | None) -> tuple[list[int], list[int]]:
        """The host part of `begin_step`: validate, reserve blocks, advance the lengths, keep an undo
        record. Returns each row's length before the step and its real tokens in it."""
        counts = self.check_step(batch_size, query_len, attention_mask)
        prev = self.lengths[:batch_size]
        # ---- from here on the step is accepted
        self._undo = (list(self.lengths), self.num_rows, self.columns_seen, query_len)
        if self.columns_seen == 0:
            self._reset_stores()  # rows start fresh: zero GDN/PLE state, EOS n-gram context
        for table in self.tables.values():
            table.begin_step(batch_size)
            for b in range(batch_size):
                table.reserve(b, prev[b] + counts[b])
        self.num_rows = batch_size
        self.columns_seen += query_len
        for b in range(batch_size):
            self.lengths[b] = prev[b] + counts[b]
        return prev, counts

    def graph_step_metadata(self, lengths: torch.Tensor, query_len: int) -> StepMetadata:
        """Metadata of a step whose lengths (``[2, rows]``: before the step, real tokens) sit in a device
        buffer, so that the same launches serve every replay of a CUDA graph: no host copies of the
        lengths, shapes sized for the cache's capacity."""
        rows = lengths.shape[1]
        block_tables = {name: t.device_table(rows, lengths.device) for name, t in self.tables.items()}
        block_sizes = {name: t.block_size for name, t in self.tables.items()}
        meta = build_step_metadata(lengths[0], lengths[1], query_len, block_tables, block_sizes, self.qsa, None,
                                   None, max_seq_len=self.max_cache_len)
        self.set_step_metadata(meta, lengths.device)
        return meta

    def set_step_metadata(self, meta: StepMetadata, device: torch.device) -> None:
        self._step = meta
        self._step_by_device = {_canonical(device): meta}

    def commit_step(self) -> None:
        """The forward finished: free blocks that fell out of the windows, forget the undo record."""
        new_lengths = self.lengths[: self.num_rows]
        for table in self.tables.values():
            table.commit_step(new_lengths)
        self._undo = None

    def abort_step(self) -> None:
        """A layer raised: return to the state before `begin_step`.

        Host state (lengths, block tables, free lists) is restored exactly. Paged stores only gained
        entries past the restored lengths, which nothing reads. Stores overwritten in place (recurrent
        state, the QSA ring): a cache that started the step empty is reset (exact); a Qwen4Exp cache
        whose rollback history covers the step (``query_len <= num_speculative_tokens``) takes back the
        state after each row's last position, as `crop` does (exact: the step's ring writes cannot reach
        it); any other is marked unusable until `reset()`.
        """
        if self._undo is None:
            return
        self.lengths, self.num_rows, self.columns_seen, query_len = self._undo
        started_empty = self.columns_seen == 0
        self._undo = None
        for table in self.tables.values():
            table.rollback_step()
        self._step = None
        self._step_by_device = {}
        if started_empty:
            self.reset()
        elif not self._exact_rollback and query_len <= self.num_speculative_tokens:
            restore_linear_states(self, self.lengths[: self.num_rows])
        elif not self._exact_rollback:
            self._mark_unusable("a forward failed after it overwrote per-row state in place (recurrent state, "
                                "QSA ring)")

    def _mark_unusable(self, why: str) -> None:
        self._unusable = f"{why}; the cache cannot return to its state before that forward: call cache.reset()"

    @contextlib.contextmanager
    def step(self, batch_size: int, query_len: int, attention_mask: torch.Tensor | None, device: torch.device):
        """``with cache.step(...) as meta:`` run one forward; it lands only if the block exits normally."""
        meta = self.begin_step(batch_size, query_len, attention_mask, device)
        try:
            yield meta
        except BaseException:
            self.abort_step()
            raise
        self.commit_step()

    @contextlib.contextmanager
    def chunked_forward(self):
        """Several steps (the chunks of one long prompt, validated whole beforehand) as one forward:
        if a chunk fails after earlier chunks landed, a cache that started empty is reset, any other
        is marked unusable (the earlier chunks cannot be taken back)."""
        columns_before = self.columns_seen
        try:
            yield
        except BaseException:
            if self.columns_seen != columns_before:  # some chunk landed
                if columns_before == 0:
                    self.reset()
                else:
                    self._mark_unusable("a chunked forward failed after some of its chunks landed")
            raise

    def _reset_stores(self) -> None:
        for layer in self.layers:
            for store in layer.stores.values():
                if store.allocated:
                    store.reset()

    def step_metadata(self, device: torch.device) -> StepMetadata:
        """This forward's metadata on ``device`` (copied once per device, for split models)."""
        if self._step is None:
            raise RuntimeError("no step in progress: the model must call cache.begin_step() first")
        device = _canonical(device)
        meta = self._step_by_device.get(device)
        if meta is None:
            meta = self._step.to(device)
            self._step_by_device[device] = meta
        return meta

    def ensure_allocated(self, layer_idx: int, device, dtype) -> LayerState:
        layer = self.layers[layer_idx]
        for store in layer.stores.values():
            if not store.allocated:
                store.allocate(device, self.dtype or dtype)
        return layer

    # ------------------------------------------------------------------ transformers Cache API
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.columns_seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.columns_seen + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return self.num_rows if self.columns_seen else -1

    @property
    def is_initialized(self) -> bool:
        return any(store.allocated for layer in self.layers for store in layer.stores.values())

    @property
    def is_croppable(self) -> bool:
        return self.model_family == "inkling" or self.num_speculative_tokens > 0

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.is_sliding for layer in self.layers]

    def update(self, *args, **kwargs):
        raise NotImplementedError(
            "QSAPagedCache is driven by the modeling files in `modeling/`; transformers' own model classes "
            "need a DynamicCache"
        )

    def reset(self) -> None:
        for table in self.tables.values():
            table.reset()
        self.lengths = [0] * self.max_batch_size
        self._crop_floor = [0] * self.max_batch_size
        self.num_rows = 0
        self.columns_seen = 0
        self._step = None
        self._step_by_device = {}
        self._undo = None
        self._unusable = None
        self._reset_stores()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes a copy of row ``beam_idx[i]`` (beam search)."""
        src = [int(i) for i in beam_idx.tolist()]
        n = len(src)
        if n != self.num_rows:
            raise ValueError(f"beam_idx has {n} entries, the cache holds {self.num_rows} rows")
        if any(not 0 <= s < n for s in src):
            raise ValueError(f"beam_idx entries must lie in [0, {n}), got {src}")
        for name, table in self.tables.items():
            old, new = table.reorder(src)  # only rows that take another row's history change
            if not new:
                continue
            for layer in self.layers:
                for store in layer.stores.values():
                    if store.table == name and store.allocated:
                        for t in store.paged_tensors():
                            data = t.index_select(0, torch.tensor(old, dtype=torch.long, device=t.device))
                            t.index_copy_(0, torch.tensor(new, dtype=torch.long, device=t.device), data)
        for layer in self.layers:
            for store in layer.stores.values():
                for t in store.row_tensors():
                    idx = torch.tensor(src, dtype=torch.long, device=t.device)
                    t[:n] = t.index_select(0, idx)
        self.lengths[:n] = [self.lengths[s] for s in src]
        self._crop_floor[:n] = [self._crop_floor[s] for s in src]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (transformers 5.23: the argument is <= 0,
        and ``crop(0)`` changes nothing). Paged stores roll back by shortening (they are addressed by
        position); Qwen4Exp's per-row states are copied back from their rollback ring (`speculative`).
        A rollback deeper than what the cache kept is refused before anything changes."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0:
            return
        drop = -tokens_to_remove
        if drop > self.columns_seen:
            raise ValueError(f"cannot drop {drop} tokens, the cache holds {self.columns_seen} columns")
        max_length = self.columns_seen - drop
        for b in range(self.num_rows):
            if self.lengths[b] < drop:
                raise ValueError(f"row {b} holds {self.lengths[b]} tokens, cannot drop {drop}")
        if self.model_family == "qwen4_exp":
            check_linear_rollback(self, drop)
        # Windowed tables keep num_speculative_tokens positions beyond what the next query reads;
        # a deeper rollback would need positions whose blocks were already freed.
        for name, table in self.tables.items():
            if table.window is None or drop == 0:
                continue
            reach = table.window - self.num_speculative_tokens
            for b in range(self.num_rows):
                new_len = self.lengths[b] - drop
                lo = max(0, new_len - reach + 1)
                needed = table.rows[b][lo // table.block_size: -(-new_len // table.block_size)]
                if lo < new_len and NULL_BLOCK in needed:
                    raise ValueError(
                        f"cannot drop {drop} tokens: row {b} needs position {lo} of the {name} window, already "
                        f"freed (the cache keeps num_speculative_tokens={self.num_speculative_tokens} extra)"
                    )
        if self.model_family == "qwen4_exp":
            restore_linear_states(self, [self.lengths[b] - drop for b in range(self.num_rows)])
        for b in range(self.num_rows):
            self.lengths[b] -= drop
            for table in self.tables.values():
                table.truncate(b, self.lengths[b])
        self.columns_seen = max_length

    def memory_stats(self) -> dict:
        """Bytes per store (summed over layers) and block usage per table."""
        bytes_per_store: dict[str, int] = {}
        for layer in self.layers:
            for store in layer.stores.values():
                for key, size in store.nbytes().items():
                    if size:
                        bytes_per_store[key] = bytes_per_store.get(key, 0) + size
        tables = {
            name: {
                "block_size": t.block_size,
                "blocks_total": t.num_blocks - 1,
                "blocks_used": t.blocks_in_use(),
                "blocks_free": len(t.free),
            }
            for name, t in self.tables.items()
        }
        return {
            "bytes": bytes_per_store,
            "total_bytes": sum(bytes_per_store.values()),
            "tables": tables,
            "rows": self.num_rows,
            "lengths": self.lengths[: self.num_rows],
        }

    def __repr__(self):
        return (f"QSAPagedCache({self.model_family}, rows={self.num_rows}/{self.max_batch_size}, "
                f"max_cache_len={self.max_cache_len}, tables={ {n: t.block_size for n, t in self.tables.items()} })")


__all__ = ["QSAPagedCache", "LayerState"]
