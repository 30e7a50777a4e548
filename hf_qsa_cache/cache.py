"""`QSAPagedCache`: paged, per-row state for Qwen4Exp and Inkling under transformers `generate()`.

This class is the transformers-facing facade (the `Cache` API, `crop`, `grow`, `reset`, `memory_stats`,
placing rows); each state has one owner it delegates to:

* what each layer keeps and how it is paged: `hf_qsa_cache.layout` (one spec per kind of state);
* ``self.tables``: one `BlockTable` per block geometry (host bookkeeping only; `hf_qsa_cache.blocks`);
* ``self.layers[i]``: a `LayerState` whose stores (`hf_qsa_cache.stores`) hold layer ``i``'s tensors,
  allocated on first write on the device and in the dtype of that layer's activations (a model split
  across GPUs keeps each layer's state beside it), or up front with ``device`` and ``dtype``;
* ``self.rows``: every row's host state (length, RoPE delta, crop floor) and the batch's row count and
  columns (`hf_qsa_cache.rows.Rows`, the only writer of those fields);
* ``self.token_log``: each row's token ids by position (`check_continues`).

A forward runs inside `step` (eager) or `transaction` (a CUDA-graph replay): a `hf_qsa_cache.step.Step`
planned and validated first, then begun (blocks reserved, rows advanced), and landed whole or taken back;
every layer reads the step's one `StepMetadata` (`step_metadata(device)`).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from transformers.cache_utils import Cache

from .blocks import default_num_blocks
from .layout import build_layout, model_family, rollback_costs_nothing, state_geometry, text_config
from .metadata import StepMetadata
from .ops.fp8 import check_cache_dtype
from . import prefix_rows
from .prefix_cache import SNAPSHOT_GAP_TOKENS, PrefixCache, Snapshot, prefix_unit
from .rollback import crop_rows
from .rows import Rows, move_rows, select_rows
from .validation import check_continues, check_model, check_request
from .step import (
    ForwardScope, MetadataSlot, RowGroup, Step, UndoCopies, forward_scope, graph_step_metadata, group_counts, plan_step,
    transaction, why_not_fits,
)
from .stores.layer_state import LayerState
from .stores.token_log import TokenLog

__all__ = ["QSAPagedCache", "LayerState", "model_family", "rollback_costs_nothing", "state_geometry"]


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


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
        kv_cache_dtype: how the paged attention K/V (QSA layers, Inkling's full and sliding layers) is stored:
            None (the model's dtype) or ``torch.float8_e4m3fn`` (fp8 with an fp32 scale per token and head,
            `hf_qsa_cache.ops.fp8`; ``docs/fp8_cache.md``).
        index_cache_dtype: the same for the QSA compressed index keys (Qwen4Exp; one scale per key). Recurrent
            state, conv windows and the QSA raw-key ring always stay in the model's dtype.
        step_undo: a step copies aside the per-row state it overwrites in place (GatedDeltaNet / PLE state and
            windows, the QSA raw-key ring), so a step that fails leaves the cache as it was (the default).
            False: no copies (their memory, ``"step_undo"`` in `memory_stats`, and the copy a step costs are
            saved); a failed step then leaves each row it fed unusable until that row is released
            (`move_rows`) or the cache is `reset()` (the other rows go on): for continuous batching, which
            releases the rows of a failed step's requests anyway (``docs/failures.md``).
        prefix_caching: keep full blocks by content and snapshots of the per-row state at block-aligned
            points, so that a new row starts from the longest cached prefix of its tokens
            (`hf_qsa_cache.prefix_cache`, ``docs/prefix_caching.md``).
        prefix_snapshots, prefix_snapshot_bytes: the most snapshots kept, and the most bytes they may take
            (default: ``2 * max_batch_size`` snapshots, no byte bound); least recently used evicted first.
        prefix_blocks: the most blocks prefix entries hold per table (default: no bound but the pool's: idle
            cached blocks are given back whenever a step needs them).
        prefix_snapshot_gap: a prefill stops at a prompt's last unit boundary to snapshot it there only if more than
            this many of its tokens come after the prefix its row was restored from (default 256; 0: always).
    """

    def __init__(self, config, max_batch_size: int, max_cache_len: int, block_size: int | None = None,
                 num_blocks: int | None = None, num_speculative_tokens: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 kv_cache_dtype: torch.dtype | None = None, index_cache_dtype: torch.dtype | None = None,
                 step_undo: bool = True, prefix_caching: bool = False, prefix_snapshots: int | None = None,
                 prefix_snapshot_bytes: int | None = None, prefix_blocks: int | None = None,
                 prefix_snapshot_gap: int = SNAPSHOT_GAP_TOKENS):
        config = text_config(config)
        for name, value in (("step_undo", step_undo), ("prefix_caching", prefix_caching)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        for name, value in (("prefix_snapshots", prefix_snapshots), ("prefix_snapshot_bytes", prefix_snapshot_bytes),
                            ("prefix_blocks", prefix_blocks)):
            if value is not None:
                _check_int(name, value, 0)
        _check_int("prefix_snapshot_gap", prefix_snapshot_gap, 0)
        self.model_family = model_family(config)
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
        check_cache_dtype("kv_cache_dtype", kv_cache_dtype)
        check_cache_dtype("index_cache_dtype", index_cache_dtype)

        self.config = config
        self.layer_types = list(config.layer_types)
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.num_speculative_tokens = num_speculative_tokens
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.index_cache_dtype = index_cache_dtype
        self.layout = build_layout(config, max_batch_size, max_cache_len, block_size, num_blocks,
                                   num_speculative_tokens, kv_cache_dtype, index_cache_dtype)
        self.qsa = self.layout.qsa
        self.tables = {name: spec.build(max_batch_size, max_cache_len) for name, spec in self.layout.tables.items()}
        super().__init__(layers=[
            LayerState(spec.layer_type, **{name: s.build(max_batch_size) for name, s in spec.stores.items()})
            for spec in self.layout.layers
        ])

        self.geometry = state_geometry(config)  # what a model must match to drive this cache
        self.rows = Rows(max_batch_size)
        self.token_log = TokenLog(max_batch_size, max_cache_len)  # what each row holds (`check_continues`)
        self.metadata = MetadataSlot()  # what the layers of the step in flight read
        self.undo = UndoCopies(self.layers, step_undo)  # the step's copies of the state it overwrites in place
        self._open: Step | None = None  # the step in flight (steps do not nest)
        self._scope: ForwardScope | None = None  # the model forward in flight (`forward_scope`)
        self.steps_started = 0  # steps opened, ever (graph runners notice steps they did not take)
        self._checked_model: tuple | None = None  # (config, dtype) last accepted by check_model
        self._unusable: str | None = None  # why the cache must be reset() before further use
        # Qwen4Exp with num_speculative_tokens: per-position state kept for crop (rollback.py)
        self.keeps_rollback_history = any(getattr(store, "history", 0) for store in self.layer_stores())
        self.graph_runners = weakref.WeakKeyDictionary()  # model -> its CUDA-graph runner (cuda_graphs.py)
        self._main_pool_follows_length = num_blocks is None  # `grow` enlarges a main pool it sized itself
        self._generate_may_grow = False  # set on a cache generate() built: a later call may `grow` it
        # Prefix caching (`hf_qsa_cache.prefix_cache`): the cached entries, or None when off.
        self.prefix: PrefixCache | None = None
        # generate()'s rows: each row's snapshot at the last unit boundary a decode step brought it to (cached when
        # the row is retired, `prefix_generation.retire_rows`); dropped whenever rows move, are copied or cropped
        # below it. Continuous batching keeps its own, by request (`ModelRunner.tails`).
        self.prefix_tails: dict[int, Snapshot] = {}
        # Whether the rows held were prefilled from token ids by `prefix_generation.prefill` (only those are
        # retired into cached prefixes: rows fed embeddings or media are not what their token ids say).
        self.prefix_rows_from_ids = False
        # Tokens the last `restore_prefix` found cached as blocks (beyond what it restored when no snapshot lies
        # there: a prefill that stops there and caches its state lets later rows restore that far).
        self.prefix_matched = 0
        if prefix_caching:
            self.prefix = PrefixCache(
                self.tables, prefix_unit(self.tables, self.qsa),
                2 * max_batch_size if prefix_snapshots is None else prefix_snapshots, prefix_snapshot_bytes,
                prefix_blocks, prefix_snapshot_gap)
        if self.device is not None:
            for store in self.layer_stores():
                store.allocate(self.device, self.dtype)
            self.undo.track()

    # ------------------------------------------------------------------ the rows' state (owned by `self.rows`)
    @property
    def lengths(self) -> list[int]:
        return self.rows.lengths

    @property
    def rope_deltas(self) -> list[int]:
        return self.rows.rope_deltas

    @property
    def num_rows(self) -> int:
        return self.rows.count

    @property
    def columns_seen(self) -> int:
        return self.rows.columns

    @property
    def rows_managed(self) -> bool:
        return self.rows.managed

    @property
    def open_step(self) -> Step | None:
        """The step in flight (a CUDA-graph runner tells it when its recorded copy of the rows has run)."""
        return self._open

    def next_positions(self, rows: int) -> list[int]:
        return self.rows.next_positions(rows)

    def layer_stores(self) -> list:
        return [store for layer in self.layers for store in layer.stores.values()]

    def all_stores(self) -> list:
        """Every layer's stores, then the cache's own token log."""
        return [*self.layer_stores(), self.token_log]

    # ------------------------------------------------------------------ validation
    def check_usable(self) -> None:
        if self._unusable is not None:
            raise ValueError(self._unusable)

    def mark_unusable(self, why: str) -> None:
        """Refuse every further step until `reset()` (the state could not be taken back)."""
        self._unusable = f"{why}; the cache cannot return to its state before that forward: call cache.reset()"

    def check_step(self, batch_size: int, query_len: int, attention_mask: torch.Tensor | None) -> list[int]:
        """Validate a forward of ``[batch_size, query_len]`` tokens without changing anything; returns the
        real-token count of each row. Models that split a long prompt into chunks call this first for the
        whole prompt, so a bad prompt is rejected before any chunk lands."""
        return plan_step(self, batch_size, query_len, attention_mask).counts

    def why_not_fits(self, new_lengths: list[int], what: str = "this step") -> str | None:
        """None if rows ``0, 1, ...`` can grow to ``new_lengths`` (``max_cache_len``, every block pool), else
        what stands in the way."""
        return why_not_fits(self, new_lengths, what)

    def longest_row(self) -> int:
        """The most tokens (prompt and generated) one row can hold with every block pool to itself:
        ``max_cache_len``, or less where a pool is smaller (a longer request cannot run, whatever else runs)."""
        limits = (table.longest_row() for table in self.tables.values())
        return min([self.max_cache_len, *(n for n in limits if n is not None)])

    def check_request(self, prompt_lengths: list[int], max_new_tokens: int) -> None:
        """Raise before any forward unless rows of ``prompt_lengths`` real tokens can each add
        ``max_new_tokens`` more (what `generate()` checks before its prefill)."""
        check_request(self, prompt_lengths, max_new_tokens)

    def check_model(self, config, dtype: torch.dtype) -> None:
        """Raise unless a model of ``config`` running in ``dtype`` lays out its state as this cache does
        (`validation.check_model`); checked once per (model config, dtype)."""
        if self._checked_model is None or self._checked_model[0] is not config or self._checked_model[1] != dtype:
            check_model(self, config, dtype)
            self._checked_model = (config, dtype)

    def check_continues(self, input_ids: torch.Tensor) -> None:
        """Raise, naming `reset()`, unless ``input_ids`` (a new `generate()` call's whole input) extends what the
        cache holds (`validation.check_continues`)."""
        check_continues(self, input_ids)

    # ------------------------------------------------------------------ steps (`hf_qsa_cache.step`)
    # ``with cache.transaction(B, L, mask) as step:`` one step as a transaction (`hf_qsa_cache.step.transaction`:
    # validated first; ``step.prev`` and ``step.counts``; lands only if the block exits normally). Bound directly:
    # no wrapper call on the decode step's host path.
    transaction = transaction

    @contextlib.contextmanager
    def step(self, batch_size: int, query_len: int, attention_mask: torch.Tensor | None, device: torch.device,
             input_ids: torch.Tensor | None = None, rope_deltas: list[int | None] | None = None):
        """``with cache.step(...) as meta:`` run one forward with this step's metadata; it lands only if the
        block exits normally (`transaction`). ``input_ids`` (None for a forward from embeddings) are logged
        for `check_continues`."""
        with self.transaction(batch_size, query_len, attention_mask, rope_deltas=rope_deltas) as step:
            meta = step.build_metadata(device)
            self.log_tokens(meta, input_ids)
            yield meta

    @contextlib.contextmanager
    def grouped_step(self, groups: list[RowGroup], counts: list[int], device: torch.device,
                     input_ids: list[torch.Tensor | None] | None = None):
        """``with cache.grouped_step(groups, counts, device) as metas:`` one step over rows placed by `move_rows`,
        run as consecutive rectangles of rows (`hf_qsa_cache.step.RowGroup`; row ``b`` takes ``counts[b]`` real
        tokens, in its group's last columns): one metadata per group, each group's layers run under
        ``cache.replaying(metas[i])``. A transaction as `step` is. ``input_ids``: each group's ``[rows, query_len]``
        ids, logged for `check_continues`."""
        batch_size = group_counts(self, groups, counts)
        with self.transaction(batch_size, max(g.query_len for g in groups), None, counts=counts) as step:
            metas = step.build_group_metadata(groups, device)
            for meta, ids in zip(metas, input_ids or [None] * len(metas)):
                self.log_tokens(meta, ids)
            yield metas

    def graph_step_metadata(self, lengths: torch.Tensor, query_len: int,
                            block_tables: dict[str, torch.Tensor] | None = None, reach: int | None = None,
                            padded: bool = False) -> StepMetadata:
        """Metadata of a step whose lengths (``[2, rows]``) sit in a device buffer, for every replay of a CUDA
        graph (`hf_qsa_cache.step.graph_step_metadata`)."""
        return graph_step_metadata(self, lengths, query_len, block_tables, reach, padded)

    # ``with cache.forward_scope():`` one call of a model's forward: its steps land only if the whole call returns
    # (`hf_qsa_cache.step.forward_scope`).
    forward_scope = forward_scope

    def after_forward(self, fn) -> None:
        """Run ``fn()`` once the model forward in flight has landed whole (now if none is in flight); never if
        it fails. What a forward adds to the prefix cache goes through here, so a failed call adds nothing."""
        if self._scope is None:
            fn()
        else:
            self._scope.on_land.append(fn)

    def log_tokens(self, meta: StepMetadata, input_ids: torch.Tensor | None) -> None:
        rows = meta.token_row + meta.row_offset if meta.row_offset else meta.token_row  # (a grouped step's group)
        self.token_log.write(meta.position, rows, input_ids)

    def step_metadata(self, device: torch.device) -> StepMetadata:
        """This forward's metadata on ``device`` (copied once per device, for split models)."""
        return self.metadata.on(device)

    def replaying(self, meta: StepMetadata):
        """Run a layer of the step ``meta`` describes, also after that step (activation checkpointing)."""
        return self.metadata.replaying(meta)

    def clear_step_metadata(self) -> None:
        self.metadata.clear()

    def ensure_allocated(self, layer_idx: int, device, dtype) -> LayerState:
        layer = self.layers[layer_idx]
        for store in layer.stores.values():
            if not store.allocated:
                store.allocate(device, self.dtype or dtype)
                self.undo.track()
        return layer

    def reset_stores(self) -> None:
        """Every allocated store back to the state a fresh row starts from."""
        for store in self.layer_stores():
            if store.allocated:
                store.reset()

    def copy_rows_aside(self, rows: int) -> None:
        """Copy the first ``rows`` rows of every state a step overwrites in place to their undo copies (one
        batched copy per dtype; also recorded inside CUDA graphs)."""
        self.undo.copy_aside(rows)

    def copy_rows_back(self, rows: int) -> None:
        """The reverse of `copy_rows_aside` (a step is taken back)."""
        self.undo.copy_back(rows)

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
        return any(store.allocated for store in self.layer_stores())

    @property
    def is_croppable(self) -> bool:
        return self.model_family == "inkling" or self.num_speculative_tokens > 0

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.is_sliding for layer in self.layers]

    @property
    def is_linear(self) -> list[bool]:
        return [layer.layer_type == "linear_attention" for layer in self.layers]

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

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
    def prefix_caching(self) -> bool:
        return self.prefix is not None

    def reset(self, prefixes: bool = False) -> None:
        """Release every row: the cache is as built (its stores stay allocated). Cached prefixes
        (``prefix_caching``) are kept unless ``prefixes`` is True."""
        if prefixes and self.prefix is not None:
            self.prefix.clear()
        self.prefix_tails = {}
        self.prefix_rows_from_ids = False
        for table in self.tables.values():
            table.reset()
        self.rows.reset()
        self.metadata.clear()
        self._open = None
        self._scope = None
        self.token_log.reset()
        self._unusable = None
        self.steps_started += 1  # a runner's next step re-validates
        self.reset_stores()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (transformers 5.23: the argument is <= 0, and
        ``crop(0)`` changes nothing); refused before anything changes if the cache kept too little
        (`hf_qsa_cache.rollback.crop_rows`)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove < 0:
            crop_rows(self, -tokens_to_remove)
            if self.prefix_tails:
                self.prefix_tails = {b: s for b, s in self.prefix_tails.items() if s.length <= self.lengths[b]}

    # ------------------------------------------------------------------ placing rows
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
        """Row ``i`` becomes a copy of row ``src[i]``; rows past ``len(src)`` are released (`rows.select_rows`)."""
        self.prefix_tails = {}
        select_rows(self, src)

    def move_rows(self, src: list[int]) -> None:
        """Place rows one by one (continuous batching): row ``i`` becomes row ``src[i]``, or a fresh row where
        ``src[i] == -1``; rows no entry names are released (`rows.move_rows`)."""
        self.prefix_tails = {}
        move_rows(self, src)

    # ------------------------------------------------------------------ prefix caching (`hf_qsa_cache.prefix_rows`)
    def restore_prefix(self, row: int, tokens, limit: int | None = None, counted: int | None = None) -> int:
        """Start empty row ``row`` from the longest cached prefix of ``tokens`` (at most ``limit`` tokens, default
        all) that has a snapshot: its shared blocks are listed (reference counted), its per-row state and windows
        copied from the snapshot, its length set. Returns the length restored (0: none cached; the row stays
        empty). ``counted``: a second look for the same tokens, whose earlier looks counted that many hit tokens
        (the hit rate counts neither the lookup again nor those hits). Outside a forward only; nothing changes if
        it raises."""
        return prefix_rows.restore_prefix(self, row, tokens, limit, counted)

    def prefix_lookup(self, tokens, limit: int | None = None) -> tuple[int, int]:
        """``(restorable, matched)``: the longest cached prefix of ``tokens`` `restore_prefix` would restore (at
        most ``limit`` tokens), and how far cached blocks reach (with or without a snapshot). Changes nothing."""
        return prefix_rows.prefix_lookup(self, tokens, limit)

    def keep_tails(self, plan) -> None:
        """After a one-token step of generate()'s rows landed: rows that reached a unit boundary keep a snapshot
        there (what the row caches when it is retired)."""
        prefix_rows.keep_tails(self, plan)

    def snapshot_row(self, row: int) -> Snapshot:
        """A copy of ``row``'s non-paged state and windows at its current length (`cache_prefix` takes it later,
        while the row's blocks below that length are unchanged)."""
        prefix_rows.check_prefix_row(self, row)
        return prefix_rows.capture(self, row)

    def cache_prefix(self, row: int, tokens, snapshot: Snapshot | None = None) -> int:
        """Keep the first tokens row ``row`` holds as a cached prefix: its whole units up to its length (which
        must then be a multiple of ``prefix_unit``) with a snapshot of its state there, or up to
        ``snapshot.length`` with ``snapshot`` (`snapshot_row`, taken when the row was that long). ``tokens``: the
        row's tokens from its first (at least that many). The row's blocks below that point are shared from now
        on (no crop goes below it). Returns the length cached (0: not aligned)."""
        return prefix_rows.cache_prefix(self, row, tokens, snapshot)

    @property
    def prefix_unit(self) -> int:
        """Tokens a cached prefix is a multiple of (the main block size: a multiple of the QSA compress ratio)."""
        return self.prefix.unit if self.prefix is not None else prefix_unit(self.tables, self.qsa)

    # ------------------------------------------------------------------ capacity and memory
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
        for store in self.layer_stores():
            if store.table is not None:
                store.resize_blocks(pools[store.table])
        self.token_log.grow(max_cache_len)
        for name, table in self.tables.items():
            table.grow(pools[name], max_cache_len)
        self.max_cache_len = max_cache_len
        self.graph_runners = weakref.WeakKeyDictionary()

    def memory_stats(self) -> dict:
        """Bytes per store (summed over layers; an fp8 store's scales counted with it) and block usage per table;
        ``bytes_per_token``: what one more token of a row costs on each table, over every layer."""
        bytes_per_store: dict[str, int] = {}
        for store in self.all_stores():
            for key, size in store.nbytes().items():
                if size:
                    bytes_per_store[key] = bytes_per_store.get(key, 0) + size
        tables = {
            name: {"block_size": t.block_size, "blocks_total": t.num_blocks - 1, "blocks_used": t.blocks_in_use(),
                   "blocks_free": len(t.free), "blocks_cached": len(t.cached), "blocks_idle_cached": t.idle}
            for name, t in self.tables.items()
        }
        dtype = self.dtype or next((s.dtype for s in self.layer_stores() if s.allocated), None)
        if dtype is not None:
            for name, table in tables.items():
                table["bytes_per_token"] = self.layout.bytes_per_token(name, dtype)
        if self.undo.nbytes():
            bytes_per_store["step_undo"] = self.undo.nbytes()
        stats = {"bytes": bytes_per_store, "total_bytes": sum(bytes_per_store.values()), "tables": tables,
                 "rows": self.num_rows, "lengths": self.lengths[: self.num_rows]}
        if self.prefix is not None:
            block_bytes = {name: self.layout.bytes_per_block(name, dtype) for name in self.tables} if dtype else {}
            stats["prefix_cache"] = self.prefix.stats(block_bytes)
        return stats

    def __repr__(self):
        return (f"QSAPagedCache({self.model_family}, rows={self.num_rows}/{self.max_batch_size}, "
                f"max_cache_len={self.max_cache_len}, tables={ {n: t.block_size for n, t in self.tables.items()} })")
