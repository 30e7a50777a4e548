"""`QSAPagedCache`: paged, per-row state for Qwen4Exp and Inkling under transformers `generate()`.

Where each state lives:

* ``self.tables``: one `BlockTable` per block geometry. ``"main"`` pages full-length attention K/V
  and the QSA compressed keys; Inkling adds ``"sliding"`` (window K/V) and ``"conv"`` (short-conv
  inputs). Tables hold host-side bookkeeping only.
* ``self.layers[i]``: a `LayerState` whose stores hold layer ``i``'s tensors (allocated on first
  write, on the device and in the dtype of that layer's activations, so a model split across GPUs
  keeps each layer's state beside it).
* ``self.lengths``: each row's logical length (real tokens, pads excluded).
* ``self.rope_deltas``: each row's multimodal RoPE offset (Qwen4Exp with images or video): a token
  given no explicit position ids is rotated at its logical position plus its row's delta on all three
  axes, so text after an image continues where the image's 3-D positions end. Zero for text-only rows;
  set by the step that carries a row's media (`transaction`).

A forward runs inside `step` (eager) or `transaction` (a CUDA-graph replay): validation first, then
block reservation and one `StepMetadata` that every layer reads (`step_metadata(device)`); the step is
a transaction (`hf_qsa_cache.transaction`): it lands whole or not at all.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .blocks import NULL_BLOCK, BlockTable, default_num_blocks
from .metadata import QSAGeometry, StepMetadata, build_step_metadata_torch
from .padding import host_step_columns
from .rollback import check_linear_rollback, restore_linear_states
from .transaction import StepTransaction
from .stores.layer_state import LayerState
from .stores.linear_state import LinearAttentionState
from .stores.paged_kv import PagedKV
from .stores.qsa_index import QSAIndexStore, ring_capacity
from .stores.token_log import TokenLog

QWEN4_LAYER_TYPES = {"indexed_attention", "linear_attention"}
INKLING_LAYER_TYPES = {"hybrid", "hybrid_sliding"}


@dataclass
class _Scope:
    columns_before: int  # columns the cache held when the forward started
    pending: StepTransaction | None = None  # the forward's last step, not landed yet


def _canonical(device) -> torch.device:
    """``cuda`` and ``cuda:<current>`` name the same device; key per-device copies by one name."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class _IndicesByDevice:
    """Row-index lists as long tensors, each made once per device (a row move touches every store's tensors)."""

    def __init__(self):
        self._made: dict[tuple[int, torch.device], tuple[list[int], torch.Tensor]] = {}

    def __call__(self, rows: list[int], device: torch.device) -> torch.Tensor:
        key = (id(rows), device)
        made = self._made.get(key)
        if made is None or made[0] is not rows:
            made = self._made[key] = (rows, torch.tensor(rows, dtype=torch.long, device=device))
        return made[1]


def _text_config(config):
    if hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return config


def rollback_costs_nothing(config) -> bool:
    """Whether a cache for this model keeps rollback headroom (``num_speculative_tokens``) at no cost a step:
    Inkling's stores are all addressed by position (a window keeps a position more); Qwen4Exp's keep a copy of
    every GatedDeltaNet and PLE state per token of headroom, written every step (`rollback`)."""
    return model_family(_text_config(config)) == "inkling"


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def build_step_metadata(prev_len: torch.Tensor, *args, **kwargs) -> StepMetadata:
    """A step's metadata: one Triton launch on CUDA, the torch specification elsewhere (same arguments
    as `hf_qsa_cache.metadata.build_step_metadata_torch`)."""
    if prev_len.is_cuda:
        from .ops.metadata_triton import build_step_metadata_triton

        return build_step_metadata_triton(prev_len, *args, **kwargs)
    return build_step_metadata_torch(prev_len, *args, **kwargs)


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
        self.rope_deltas = [0] * max_batch_size
        self._crop_floor = [0] * max_batch_size  # Qwen4Exp: shortest length a crop may reach (rollback.py)
        self.num_rows = 0  # rows of the batch in flight
        self.columns_seen = 0  # rectangular length (pads included) that generate() reasons in
        # Rows placed one by one (`move_rows`, continuous batching) rather than a batch generate() holds: a step
        # may then cover any prefix of the rows, and an aborted step never resets the others.
        self.rows_managed = False
        self._step: StepMetadata | None = None
        self._step_by_device: dict[torch.device, StepMetadata] = {}
        self._open: StepTransaction | None = None  # the step in flight (steps do not nest)
        self._scope: _Scope | None = None  # the model forward in flight (`forward_scope`)
        self.token_log = TokenLog(max_batch_size, max_cache_len)  # what each row holds (`check_continues`)
        self.steps_started = 0  # steps opened, ever (graph runners notice steps they did not take)
        self._checked_model: tuple | None = None  # (config, dtype) last accepted by check_model
        self._unusable: str | None = None  # why the cache must be reset() before further use
        # Qwen4Exp with num_speculative_tokens: per-position state kept for crop (rollback.py)
        self.keeps_rollback_history = any(
            getattr(store, "history", 0) for layer in layers for store in layer.stores.values()
        )
        self.graph_runners = weakref.WeakKeyDictionary()  # model -> its CUDA-graph runner (cuda_graphs.py)
        self._row_views: dict[int, list] = {}  # `inplace_row_views`, by row count
        self._main_pool_follows_length = num_blocks is None  # `grow` enlarges a main pool it sized itself
        self._generate_may_grow = False  # set on a cache generate() built: a later call may `grow` it
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
        if num_blocks is None:
            num_blocks = default_num_blocks(self.max_batch_size, block_size, self.max_cache_len)
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
        """Real tokens per row in this forward (the mask's last ``query_len`` columns).

        Within the step a row's pads must come before its real tokens (the models reorder any other
        mask to that layout first: `hf_qsa_cache.padding`); the columns before the step may hold pads
        anywhere (a right-padded prompt, then tokens generated after the pads). A row that holds tokens
        may have pads in a step: its state continues at its real length."""
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
        if query_len == 1 and 0 not in self.lengths[:batch_size]:  # no row starts in this step
            # generate() appends a 1 for every row at every step; trusting it keeps decode free of host syncs.
            return [1] * batch_size
        mask = host_step_columns(attention_mask, query_len).to(torch.int64)  # read once (step_order shares it)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 and 1")
        steps = mask[:, 1:] - mask[:, :-1]
        bad = (steps < 0).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"the step's attention_mask columns are not left-padded: row {bad[0]} has a real token before a "
                "pad (the models reorder such masks before the step: hf_qsa_cache.padding.step_order)"
            )
        return mask.sum(dim=1).tolist()

    def check_step(self, batch_size: int, query_len: int, attention_mask: torch.Tensor | None) -> list[int]:
        """Validate a forward of ``[batch_size, query_len]`` tokens without changing anything.

        Returns the real-token count of each row. Models that split a long prompt into chunks call
        this first for the whole prompt, so a bad prompt is rejected before any chunk lands.
        """
        return self._check_step(batch_size, query_len, attention_mask)[0]

    def _check_step(self, batch_size: int, query_len: int, attention_mask: torch.Tensor | None):
        """`check_step`'s checks; returns (real tokens per row, each row's length after the step)."""
        if self._unusable is not None:
            raise ValueError(self._unusable)
        if query_len < 1 or batch_size < 1:
            raise ValueError(f"a step needs at least one row and one token, got input of shape [{batch_size}, {query_len}]")
        if batch_size > self.max_batch_size:
            raise ValueError(f"batch of {batch_size} rows exceeds max_batch_size={self.max_batch_size}")
        if self.rows_managed:
            if batch_size > self.num_rows:
                raise ValueError(f"a step over {batch_size} rows, the cache holds {self.num_rows} (move_rows admits rows)")
        elif self.columns_seen > 0 and batch_size != self.num_rows:
            raise ValueError(
                f"the cache holds a batch of {self.num_rows} rows in flight, got {batch_size}; call reset() first"
            )
        counts = self._row_counts(batch_size, query_len, attention_mask)
        new_lengths = list(map(operator.add, self.lengths[:batch_size], counts))
        self._check_fits(new_lengths)
        return counts, new_lengths

    def _check_fits(self, new_lengths: list[int], what: str = "this step") -> None:
        """Raise unless rows growing to ``new_lengths`` fit ``max_cache_len`` and every block pool."""
        problem = self.why_not_fits(new_lengths, what)
        if problem is not None:
            raise ValueError(problem)

    def why_not_fits(self, new_lengths: list[int], what: str = "this step") -> str | None:
        """None if rows ``0, 1, ...`` can grow to ``new_lengths`` (``max_cache_len``, every block pool), else
        what stands in the way."""
        if new_lengths and max(new_lengths) > self.max_cache_len:
            b, need = next((b, n) for b, n in enumerate(new_lengths) if n > self.max_cache_len)
            return f"row {b} needs {need} slots, cache holds max_cache_len={self.max_cache_len}"
        for name, table in self.tables.items():
            need = table.blocks_needed_rows(new_lengths)
            if need > len(table.free):
                return (f"{name} block pool: {what} needs {need} free blocks of {table.block_size} tokens, "
                        f"{len(table.free)} are free (num_blocks={table.num_blocks})")
        return None

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
        if held is not None and held != dtype and self.dtype is None and self.columns_seen == 0:
            # Built to follow the model, and empty (new or reset): follow it into its new dtype.
            self._row_views.clear()
            for layer in self.layers:
                for store in layer.stores.values():
                    store.deallocate()
        elif held is not None and held != dtype:
            if self.dtype is None:
                raise ValueError(
                    f"the cache holds state of a model that ran in dtype={held}, this one runs in dtype={dtype}: "
                    f"call cache.reset() first (an empty cache built without device/dtype follows the model)"
                )
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

    @contextlib.contextmanager
    def transaction(self, batch_size: int, query_len: int, attention_mask: torch.Tensor | None,
                    copy_rows: bool = True, rope_deltas: list[int | None] | None = None):
        """``with cache.transaction(B, L, mask) as (prev, counts):`` one step, as a transaction.

        Validates first (nothing changes on error), then reserves blocks, advances the lengths and copies
        the in-place state of the step's rows aside. The step lands only if the block exits normally;
        any exception (host code, metadata, a layer, a graph replay) takes every change back
        (`hf_qsa_cache.transaction`). Yields each row's length before the step and its real tokens in it.

        ``rope_deltas``: each row's RoPE offset after this step (None keeps a row's; see ``self.rope_deltas``).

        ``copy_rows=False``: the caller copies the rows aside itself, inside a recorded CUDA graph
        (`copy_rows_aside`), and says so once that copy has run (`rows_copied_aside`); until then an abort
        restores nothing in place (nothing was written there).
        """
        if self._open is not None:
            raise RuntimeError("a step of this cache is already in flight (steps do not nest)")
        if self._scope is not None and self._scope.pending is not None:
            self._scope.pending.commit()  # the previous chunk of this forward lands first
            self._scope.pending = None
        counts, new_lengths = self._check_step(batch_size, query_len, attention_mask)
        prev = self.lengths[:batch_size]
        txn = self._open = StepTransaction(self, batch_size)
        self.steps_started += 1
        try:
            if txn.started_empty:
                self._reset_stores()  # rows start fresh: zero GDN/PLE state, EOS n-gram context
            if copy_rows:
                txn.save_rows()
            for table in self.tables.values():
                table.reserve_rows(new_lengths)
            self.num_rows = max(self.num_rows, batch_size) if self.rows_managed else batch_size
            self.columns_seen += query_len
            self.lengths[:batch_size] = new_lengths
            for b, delta in enumerate(rope_deltas or []):
                if delta is not None:
                    self.rope_deltas[b] = int(delta)
            yield prev, counts
        except BaseException:
            self._open = None
            txn.abort()
            raise
        self._open = None
        if self._scope is not None:
            self._scope.pending = txn  # lands when the model's whole forward returns
        else:
            txn.commit()

    @contextlib.contextmanager
    def step(self, batch_size: int, query_len: int, attention_mask: torch.Tensor | None, device: torch.device,
             input_ids: torch.Tensor | None = None, rope_deltas: list[int | None] | None = None):
        """``with cache.step(...) as meta:`` run one forward with this step's metadata; it lands only if
        the block exits normally (`transaction`). ``input_ids`` (None for a forward from embeddings) are
        logged for `check_continues`."""
        with self.transaction(batch_size, query_len, attention_mask, rope_deltas=rope_deltas) as (prev, counts):
            device = _canonical(device)
            lengths = torch.tensor([prev, counts], dtype=torch.int32)  # one host-to-device copy per step
            if device.type == "cuda":
                lengths = lengths.to(device, non_blocking=True)
            block_tables = {name: t.device_table(batch_size, device) for name, t in self.tables.items()}
            block_sizes = {name: t.block_size for name, t in self.tables.items()}
            meta = build_step_metadata(lengths[0], lengths[1], query_len, block_tables, block_sizes, self.qsa,
                                       prev, counts)
            self.set_step_metadata(meta, device)
            self.log_tokens(meta, input_ids)
            try:
                yield meta
            finally:
                self.clear_step_metadata()

    def graph_step_metadata(self, lengths: torch.Tensor, query_len: int,
                            block_tables: dict[str, torch.Tensor] | None = None,
                            reach: int | None = None) -> StepMetadata:
        """Metadata of a step whose lengths (``[2, rows]``: before the step, real tokens) sit in a device
        buffer, so that the same launches serve every replay of a CUDA graph: no host copies of the
        lengths, shapes sized for ``reach`` tokens per row (default: the cache's capacity; the caller
        guarantees no row holds more after the step). ``block_tables``: the device tables to read
        (default: the persistent ones, brought up to date)."""
        reach = self.max_cache_len if reach is None else reach
        rows = lengths.shape[1]
        if block_tables is None:
            block_tables = {name: t.device_table(rows, lengths.device) for name, t in self.tables.items()}
        block_sizes = {name: t.block_size for name, t in self.tables.items()}
        meta = build_step_metadata(lengths[0], lengths[1], query_len, block_tables, block_sizes, self.qsa, None,
                                   None, max_seq_len=reach)
        self.set_step_metadata(meta, lengths.device)
        return meta

    def next_positions(self, rows: int) -> list[int]:
        """The RoPE position each of the first ``rows`` rows continues at (its length plus its delta)."""
        return [self.lengths[b] + self.rope_deltas[b] for b in range(rows)]

    def log_tokens(self, meta: StepMetadata, input_ids: torch.Tensor | None) -> None:
        self.token_log.write(meta.position, meta.token_row, input_ids)

    def check_continues(self, input_ids: torch.Tensor) -> None:
        """Raise, naming `reset()`, unless ``input_ids`` ``[B, W]`` (a new `generate()` call's whole
        input) extends what the cache holds: the same rows, more columns, and the held tokens first.
        transformers feeds a passed cache only the columns past what it holds, so anything else would
        silently continue the old sequences. Once per `generate()` call (one host sync)."""
        if self.columns_seen == 0:
            return
        rows, width = input_ids.shape[:2]
        if rows != self.num_rows:
            raise ValueError(f"the cache holds {self.num_rows} rows of an earlier call, this call has {rows}: "
                             f"call cache.reset() before a new batch")
        if width <= self.columns_seen:
            raise ValueError(f"the cache holds {self.columns_seen} columns of an earlier call and input_ids has "
                             f"{width}, so it does not continue them: call cache.reset() before a new prompt")
        bad = self.token_log.mismatched_rows(input_ids, self.lengths[:rows], self.columns_seen)
        if bad:
            raise ValueError(f"row {bad[0]} of input_ids does not start with the tokens the cache holds for it: "
                             f"call cache.reset() before a new prompt")

    def set_step_metadata(self, meta: StepMetadata, device: torch.device) -> None:
        self._step = meta
        self._step_by_device = {_canonical(device): meta}

    def clear_step_metadata(self) -> None:
        self._step = None
        self._step_by_device = {}

    def mark_unusable(self, why: str) -> None:
        """Refuse every further step until `reset()` (the state could not be taken back)."""
        self._unusable = f"{why}; the cache cannot return to its state before that forward: call cache.reset()"

    @contextlib.contextmanager
    def forward_scope(self):
        """``with cache.forward_scope():`` one call of a model's forward (its steps, the LM head, the
        loss): the steps it runs land only if the whole call returns.

        A step ends pending inside a scope; the next step of the same call (a chunk of a long prompt)
        commits it first, and the scope commits the last one when the call returns. If the call
        raises, the pending step is taken back; if earlier chunks of the call had landed, a cache that
        was empty before the call is reset, any other refuses further steps until `reset()` (landed
        chunks cannot be taken back). Scopes nest: only the outermost one counts.
        """
        if self._scope is not None:
            yield
            return
        scope = self._scope = _Scope(columns_before=self.columns_seen)
        try:
            yield
        except BaseException:
            self._scope = None
            if scope.pending is not None:
                scope.pending.abort()
            if self.columns_seen != scope.columns_before:  # earlier steps of this call landed
                if scope.columns_before == 0:
                    self.reset()
                else:
                    self.mark_unusable("a forward failed after some of its chunks landed")
            raise
        self._scope = None
        if scope.pending is not None:
            scope.pending.commit()

    def _reset_stores(self) -> None:
        for layer in self.layers:
            for store in layer.stores.values():
                if store.allocated:
                    store.reset()

    @contextlib.contextmanager
    def replaying(self, meta: StepMetadata):
        """Run a layer of the step ``meta`` describes. A no-op inside that step; after it (activation
        checkpointing recomputes layers during backward) the step's metadata is put back for the layer's
        run. The recompute writes the values the step wrote, to the same slots."""
        if self._step is meta:
            yield
            return
        saved = self._step, self._step_by_device
        self._step, self._step_by_device = meta, {}
        try:
            yield
        finally:
            self._step, self._step_by_device = saved

    def step_metadata(self, device: torch.device) -> StepMetadata:
        """This forward's metadata on ``device`` (copied once per device, for split models)."""
        if self._step is None:
            raise RuntimeError("no step in progress: the model must run inside cache.step()")
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
                self._row_views.clear()
                store.allocate(device, self.dtype or dtype)
        return layer

    def copy_rows_aside(self, rows: int) -> None:
        """Copy the first ``rows`` rows of every state a step overwrites in place to their undo copies (one
        batched copy per dtype; also recorded inside CUDA graphs)."""
        with torch.no_grad():  # cached state is never differentiated (and foreach copies refuse int64 under grad)
            for live, saved in self.inplace_row_views(rows):
                torch._foreach_copy_(saved, live)

    def copy_rows_back(self, rows: int) -> None:
        """The reverse of `copy_rows_aside` (a step is taken back)."""
        with torch.no_grad():
            for live, saved in self.inplace_row_views(rows):
                torch._foreach_copy_(live, saved)

    def rows_copied_aside(self, rows: int) -> None:
        """The open step's rows were copied aside by its caller (`transaction(copy_rows=False)`)."""
        if self._open is not None:
            self._open.mark_saved(rows)

    def inplace_row_views(self, rows: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """``[(live, saved)]``: views of the first ``rows`` rows of every state a step overwrites in place, and
        of their copies (`hf_qsa_cache.transaction`), one pair of lists per (device, dtype). torch's foreach
        copy batches a list of one dtype into a few launches, and copies a mixed list one tensor at a time
        (a Qwen4Exp 40-layer graphed decode step on an H200 went from 117 copies to 35 when the lists were
        split by dtype, `benchmarks/bench_generate.py`). Kept per row count: building ~100 views costs more host
        time than a graphed decode step can spare, and they change only when a store is allocated."""
        views = self._row_views.get(rows)
        if views is None:
            groups: dict[tuple, tuple[list, list]] = {}
            for layer in self.layers:
                for store in layer.stores.values():
                    for state, copy in store.inplace_rows():
                        live, saved = groups.setdefault((state.device, state.dtype), ([], []))
                        live.append(state[:rows])
                        saved.append(copy[:rows])
            views = self._row_views[rows] = list(groups.values())
        return views

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

    # transformers' own models read and write dense per-layer state through these; ours go through the stores.
    update_conv_state = update_recurrent_state = update_indexer = update
    get_conv_state = get_recurrent_state = update

    def early_initialization(self, *args, **kwargs):
        raise NotImplementedError("QSAPagedCache allocates up front when built with device= and dtype=")

    def offload(self, *args, **kwargs):
        raise NotImplementedError("QSAPagedCache keeps each layer's state on that layer's device (no offloading)")

    prefetch = offload

    def activate_past_recording(self) -> None:
        """Nothing to switch on: rollback history is sized at construction (``num_speculative_tokens``), and
        generate() checks it before assisted decoding starts."""

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.columns_seen > 0

    @property
    def is_linear(self) -> list[bool]:
        return [layer.layer_type == "linear_attention" for layer in self.layers]

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    def reset(self) -> None:
        for table in self.tables.values():
            table.reset()
        self.lengths = [0] * self.max_batch_size
        self.rope_deltas = [0] * self.max_batch_size
        self._crop_floor = [0] * self.max_batch_size
        self.num_rows = 0
        self.columns_seen = 0
        self.clear_step_metadata()
        self._open = None
        self._scope = None
        self.token_log.reset()
        self._unusable = None
        self.rows_managed = False
        self.steps_started += 1  # a runner's next step re-validates
        self._reset_stores()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes a copy of row ``beam_idx[i]`` (beam search)."""
        src = [int(i) for i in beam_idx.tolist()]
        if len(src) != self.num_rows:
            raise ValueError(f"beam_idx has {len(src)} entries, the cache holds {self.num_rows} rows")
        self.select_rows(src)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` consecutive copies of itself (as transformers' caches do)."""
        _check_int("repeats", repeats, 1)
        self.select_rows([b for b in range(self.num_rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (in that order); the others give their blocks back."""
        self.select_rows([int(i) for i in torch.as_tensor(indices).flatten().tolist()])

    def select_rows(self, src: list[int]) -> None:
        """Row ``i`` becomes a copy of row ``src[i]``; rows past ``len(src)`` are released.

        Everything is checked first (row indices, ``max_batch_size``, free blocks for the copies), and the
        device data is gathered before anything is written, so a refusal changes nothing.
        """
        if self._open is not None:
            raise RuntimeError("cannot move rows while a step is in flight")
        if self._unusable is not None:
            raise ValueError(self._unusable)
        n, held = len(src), self.num_rows
        if not 1 <= n <= self.max_batch_size:
            raise ValueError(f"the cache can hold 1 to max_batch_size={self.max_batch_size} rows, asked for {n}")
        if any(not 0 <= s < held for s in src):
            raise ValueError(f"row indices must lie in [0, {held}) (rows the cache holds), got {src}")
        for name, table in self.tables.items():
            need, have = table.blocks_for_select(src, held), len(table.free)
            if need > have:
                raise ValueError(f"{name} block pool: copying rows needs {need} more free blocks of "
                                 f"{table.block_size} tokens, {have} are free (num_blocks={table.num_blocks})")
        gathered = []  # (row tensor, its new rows): read everything before the first write
        indices = _IndicesByDevice()
        for store in self._all_stores():
            for t in store.row_tensors():
                gathered.append((t, t.index_select(0, indices(src, t.device))))
        plans = {name: table.select_rows(src, held) for name, table in self.tables.items()}
        self.lengths = [self.lengths[s] for s in src] + [0] * (self.max_batch_size - n)
        self.rope_deltas = [self.rope_deltas[s] for s in src] + [0] * (self.max_batch_size - n)
        self._crop_floor = [self._crop_floor[s] for s in src] + [0] * (self.max_batch_size - n)
        self.num_rows = n
        try:
            for name, (old, new) in plans.items():
                if not new:
                    continue
                for layer in self.layers:
                    for store in layer.stores.values():
                        if store.table == name and store.allocated:
                            for t in store.paged_tensors():
                                data = t.index_select(0, indices(old, t.device))
                                t.index_copy_(0, indices(new, t.device), data)
            for t, data in gathered:
                t[:n] = data
        except BaseException as error:
            self.mark_unusable(f"copying rows failed half way ({type(error).__name__}: {error})")
            raise

    def move_rows(self, src: list[int]) -> None:
        """Place rows one by one (continuous batching): row ``i`` becomes row ``src[i]``, or a fresh, empty row
        for a new sequence where ``src[i] == -1``; rows no entry names are released (their blocks return to
        the pools). Paged data does not move (blocks change owner); per-row state (GatedDeltaNet / PLE state,
        QSA ring, token log) is copied for the rows that change place only, one gather per tensor. Afterwards a forward may cover any prefix
        of the rows (`check_step`), and a failed step leaves every row as it was.

        Everything is checked first; a failure while copying refuses further steps, naming `reset()`.
        """
        if self._open is not None:
            raise RuntimeError("cannot move rows while a step is in flight")
        if self._unusable is not None:
            raise ValueError(self._unusable)
        held = self.num_rows
        kept = [s for s in src if s != -1]
        if len(src) > self.max_batch_size:
            raise ValueError(f"the cache can hold up to max_batch_size={self.max_batch_size} rows, asked for {len(src)}")
        if any(not 0 <= s < held for s in kept) or len(set(kept)) != len(kept):
            raise ValueError(f"entries must be distinct rows in [0, {held}) or -1 (a fresh row), got {src}")
        moved = [i for i, s in enumerate(src) if s not in (i, -1)]  # only rows that change place are copied
        gathered = []  # read every moved row before the first write
        if moved:
            sources, indices = [src[i] for i in moved], _IndicesByDevice()
            for store in self._all_stores():
                for t in store.row_tensors():
                    gathered.append((t, indices(moved, t.device), t.index_select(0, indices(sources, t.device))))
        try:  # from the first change on, a failure refuses further steps (naming reset())
            for table in self.tables.values():
                table.move_rows(src, held)
            pad = [0] * (self.max_batch_size - len(src))
            self.lengths = [self.lengths[s] if s >= 0 else 0 for s in src] + pad
            self.rope_deltas = [self.rope_deltas[s] if s >= 0 else 0 for s in src] + pad
            self._crop_floor = [self._crop_floor[s] if s >= 0 else 0 for s in src] + pad
            self.num_rows = len(src)
            self.rows_managed = True
            self.columns_seen = max(self.columns_seen, 1)  # generate()'s whole-batch rules no longer apply
            for t, rows, data in gathered:
                t.index_copy_(0, rows, data)
            fresh = [i for i, s in enumerate(src) if s == -1]
            if fresh:
                for layer in self.layers:
                    for store in layer.stores.values():
                        if store.allocated and hasattr(store, "reset_rows"):
                            store.reset_rows(fresh)
        except BaseException as error:
            self.mark_unusable(f"moving rows failed half way ({type(error).__name__}: {error})")
            raise

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (transformers 5.23: the argument is <= 0,
        and ``crop(0)`` changes nothing). Paged stores roll back by shortening (they are addressed by
        position); Qwen4Exp's per-row states are copied back from their rollback ring (`rollback`).
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
            floors = list(self._crop_floor)
            try:
                restore_linear_states(self, [self.lengths[b] - drop for b in range(self.num_rows)])
            except BaseException as error:
                # Some layers may hold the cropped state already: put every layer back to the current
                # lengths (the ring holds the state after each row's last position, which checks above
                # guarantee), or refuse further steps.
                try:
                    restore_linear_states(self, self.lengths[: self.num_rows])
                    self._crop_floor = floors  # the floors before this crop (restoring raises them)
                except BaseException:
                    self.mark_unusable(f"a crop failed half way ({type(error).__name__}: {error})")
                raise
        for b in range(self.num_rows):
            self.lengths[b] -= drop
            for table in self.tables.values():
                table.truncate(b, self.lengths[b])
        self.columns_seen = max_length

    def _all_stores(self) -> list:
        """Every layer's stores, then the cache's own token log."""
        return [*(store for layer in self.layers for store in layer.stores.values()), self.token_log]

    def grow(self, max_cache_len: int) -> None:
        """Raise ``max_cache_len`` in place, keeping everything the cache holds.

        Rows may then reach ``max_cache_len`` tokens: each block table widens and each pool sized from the
        length (the main pool unless built with ``num_blocks``; the windowed ones always) gains the blocks
        its rows now need. Every paged store grows its own tensors to its table's new pool and copies the
        held blocks; per-row state (rings, GatedDeltaNet / PLE state, rollback history) does not depend on
        the length and is left as is. Held blocks keep their ids, so block tables, free lists, lengths and
        rollback headroom stay valid. Captured CUDA graphs are dropped (they hold the old buffers' addresses).

        Stores grow before the tables: if an allocation fails, the cache still serves its old capacity.
        A smaller or equal ``max_cache_len`` changes nothing.
        """
        _check_int("max_cache_len", max_cache_len, 1)
        if self._open is not None or self._scope is not None:
            raise RuntimeError("cannot grow the cache while a forward is in flight")
        if max_cache_len <= self.max_cache_len:
            return
        pools = {}
        for name, table in self.tables.items():
            follows = table.window is not None or self._main_pool_follows_length
            need = default_num_blocks(self.max_batch_size, table.block_size, max_cache_len, table.window)
            pools[name] = max(table.num_blocks, need) if follows else table.num_blocks
        for layer in self.layers:
            for store in layer.stores.values():
                if store.table is not None:
                    store.resize_blocks(pools[store.table])
        self.token_log.grow(max_cache_len)
        for name, table in self.tables.items():
            table.grow(pools[name], max_cache_len)
        self.max_cache_len = max_cache_len
        self._row_views.clear()
        self.graph_runners = weakref.WeakKeyDictionary()

    def memory_stats(self) -> dict:
        """Bytes per store (summed over layers) and block usage per table."""
        bytes_per_store: dict[str, int] = {}
        for store in self._all_stores():
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
