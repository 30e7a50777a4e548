"""Decode, verify, short prefill and mixed steps replayed from captured CUDA graphs.

A decode step of a small batch is launch-bound: hundreds of small kernels per layer, a few
microseconds of GPU work each. `DecodeGraphs` captures the whole step (metadata kernel, every
layer, the LM head) once per (batch-size bucket, step length) and replays it. Step lengths are 1
(decode) and, on a cache with ``num_speculative_tokens = k``, up to ``min(k + 1, MAX_STEP_LEN)``
(verifying drafts). A short prefill step (`short_prefill_length`: a power-of-two count of the first
rows, every one of them started or placed by continuous batching, at most ``SHORT_PREFILL_TOKENS`` tokens
once its length is rounded up to a power of two) is bound by host work the same way (an eager step at 40
layers of Qwen4Exp on an H100: about 125 ms at 1 x 256, 186 ms at 1 x 2048, nearly all host work, against
milliseconds of GPU work); its tokens are left-padded to the rounded length and it replays that length's
graph. Continuous batching sends many: a prompt's last tokens after its prefix-caching snapshot point, a
short prompt admitted while the others decode (its first step too). A mixed step (`DecodeGraphs.mixed_step`) is
such a short prefill step with every other row's decode token beside it: a grouped step of two groups.
Everything the step reads lives in static device buffers updated in place before a replay:

* ``ids`` ``[bucket, L]``, ``lengths`` ``[2, bucket]`` (each row's length before the step, and its
  real tokens in it: L, or 0 for the bucket's padding rows), ``positions`` ``[3, bucket, L]``;
* the cache's persistent block tables (`BlockTable.device_table` writes only changed entries);
* the stores themselves (paged K/V, rings, per-row state), whose addresses never change.

The host part of a step is the cache's usual validation and block reservation (``transaction``):
work per row, no device sync for decode (a verify step reads its mask once). Shapes that would grow
with context are sized for the step's reach (`reach_bucket`: the longest row after the step, rounded
up to a power of two, at least ``MIN_GRAPH_REACH`` and at most the cache's capacity), so a graph serves
until a row crosses a power of two, and a cache sized for 1M tokens decodes a short prompt with the
shapes of a cache sized for it (the QSA scores and top-k, and Inkling's full-attention splits, span the
reach, not the capacity).

A bucket's first step runs eagerly (which also compiles and tunes kernels) on exactly the path the
graph records, then the graph is captured; later steps replay it. If a capture fails (a module that
syncs with the host, say), that bucket runs eagerly from then on, with one warning, and the failure
is remembered on the model (`capture_failures`): every later cache (each generate() call builds
one) runs steps of that shape eagerly at once instead of paying the failed capture again. Graphs
belong to one (cache, model) pair and stay valid across `QSAPagedCache.reset()`.

Mixture-of-experts layers run the model's experts implementation. Under our default (``hf_qsa``), graph steps
of at most ``SELECTED_EXPERTS_MAX_TOKENS`` tokens run ``hf_qsa_selected`` (Triton kernels reading only the
selected experts' weights) unless ``HF_QSA_FUSED`` leaves ``experts`` out; larger ones our own grouped path
where it captures (its tiled kernels, or torch's grouped GEMM in bf16 on compute capability 9.x/10.x), else
transformers' ``batched_mm``. The experts op chooses (`hf_qsa_cache.ops.experts.graph_experts`). An
implementation the user chose (``eager``, ``batched_mm``, ``grouped_mm``, ...) runs as chosen in graph steps too
(transformers' `generate()` switches ``grouped_mm`` to ``batched_mm`` for its decode steps on a GPU).

Off with ``HF_QSA_CUDA_GRAPHS=0`` in the environment or ``model.use_cuda_graphs = False``.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .blocks import device_tables
from .cache import QSAPagedCache
from .graph_validity import (_probe, capture_failures, capture_key, collector_paused, experts_family,
                             experts_modules, experts_running, model_fingerprint, remember_capture_failure)
from .grouped import group_ids, group_parts
from .step import RowGroup, canonical_device
# The experts a graph step runs are chosen by the experts op (`hf_qsa_cache.ops.experts.graph_experts`).
from .ops.experts import graph_experts


# Longest verify step that gets graphs (one per length and bucket); longer ones run eagerly.
MAX_STEP_LEN = 8
# Prefill steps of the first rows (a power of two of them, all started or placed by continuous batching) whose
# rows x length, the length rounded up to a power of two of at least SHORT_PREFILL_MIN_LEN, is at most
# SHORT_PREFILL_TOKENS replay graphs of that length (`short_prefill_length`); longer ones run eagerly (their GPU
# work outweighs the host's).
SHORT_PREFILL_TOKENS = 256
SHORT_PREFILL_MIN_LEN = 32
# Shortest reach a graph step is sized for (`reach_bucket`): below it, widths cost about the same, and
# fewer reaches mean fewer captures.
MIN_GRAPH_REACH = 4096


def enabled_by_default() -> bool:
    return os.environ.get("HF_QSA_CUDA_GRAPHS", "1") != "0"


@dataclass
class _Bucket:
    ids: torch.Tensor  # [bucket, L] int64
    reach: int  # tokens any row may hold after the step: the width of the step's length-sized shapes
    lengths: torch.Tensor  # [2, bucket] int32
    positions: torch.Tensor | None  # [3, bucket, L] int64 (models with position ids)
    table_ptrs: dict[str, int]  # device-table addresses the step reads
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [bucket, L, vocab], written by each replay
    eager: bool = False  # capture failed (here or on an earlier cache): run the static-buffer step eagerly
    experts: str | None = None  # experts implementation the step runs instead of the model's own
    key: tuple = ()  # what decides whether the step captures (`capture_key`)
    padded: bool = False  # recorded for rows that take fewer tokens than the step (left-padded verify steps)
    # A mixed step (`DecodeGraphs.mixed_step`): its first rows' prefill group (0: a rectangle, ``ids [bucket, L]``;
    # else ``ids [1, prefill_rows * L + decoding rows]``), its length L and the token indices it takes logits of.
    prefill_rows: int = 0
    length: int = 0
    keep: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.lengths.shape[1]


def reach_bucket(longest: int, max_cache_len: int) -> int:
    """The reach a step whose longest row holds ``longest`` tokens after it is sized for: a power of two from
    ``MIN_GRAPH_REACH`` on, capped by the cache's capacity."""
    return min(max(MIN_GRAPH_REACH, 1 << max(0, longest - 1).bit_length()), max_cache_len)


class DecodeGraphs:
    """The captured decode steps of one model on one cache, by batch-size bucket.

    ``record=False`` runs the same static-buffer step eagerly instead of replaying a graph (the CPU
    tests use it to check that path against the ordinary forward).
    """

    def __init__(self, model, cache: QSAPagedCache, device: torch.device, record: bool = True):
        # Both held weakly: the cache keeps runners per model, and must not keep a deleted model alive; nor may
        # a runner keep its cache (a cycle): a dropped cache's graphs would then wait for Python's collector,
        # which may run in the middle of another capture, where destroying a graph invalidates it.
        self._model = weakref.ref(model)
        self._cache = weakref.ref(cache)
        # ("cuda" and "cuda:0" are unequal devices: the block tables would move to a new copy every step, and the
        # graphs that read the old one be dropped and captured again.)
        self.device = canonical_device(device)
        self.record = record
        self.pool = torch.cuda.graph_pool_handle() if record and self.device.type == "cuda" else None
        # (rows bucket, step length, reach, padded) -> buffers, graph
        self.buckets: dict[tuple[int, int, int, bool], _Bucket] = {}
        self.model_state = model_fingerprint(model)  # what the recorded graphs read (checked at replay)
        self.model_dtype = model.dtype  # (walks the parameters: refreshed with model_state, not every step)
        self.probe = _probe(model)  # the cheap part of that check, done every step
        self.steps_seen = -1  # cache.steps_started when this runner last opened a step
        self.replays = 0  # steps replayed from a recorded graph (benchmarks count them)
        # Steps that recorded a graph, and the host seconds they took (the step itself run on the graph's path, then
        # its capture): what meeting a new shape costs a serving loop (benchmarks count them).
        self.recordings, self.recording_s = 0, 0.0
        self._set_experts(experts_modules(model))  # refreshed with model_state

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise RuntimeError("the model of these CUDA graphs was deleted")
        return model

    @property
    def cache(self) -> QSAPagedCache:
        cache = self._cache()
        if cache is None:  # only a runner kept apart from its cache (the cache holds its runners)
            raise RuntimeError("the cache of these CUDA graphs was deleted")
        return cache

    def bucket(self, rows: int) -> int:
        """Powers of two up to the cache's row count: few graphs, little padding."""
        return min(1 << max(0, rows - 1).bit_length(), self.cache.max_batch_size)

    def reach_bucket(self, longest: int) -> int:
        return reach_bucket(longest, self.cache.max_cache_len)

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
             attention_mask: torch.Tensor | None) -> torch.Tensor:
        """One step of ``input_ids`` ``[B, L]``; returns logits ``[B, L, vocab]``, or ``[B, 1, vocab]`` (the last
        column) for a prefill-sized step (`keeps_last_column`)."""
        cache = self.cache
        rows, taken = input_ids.shape
        # (A shape `takes_graph_step` refuses runs at its own length: benchmarks/check_prefill_graphs.py sends any.)
        length = recorded_length(cache, rows, taken) or taken
        if length > taken:  # a short prefill step: left-padded to its recorded length
            input_ids, position_ids, attention_mask = left_padded(input_ids, position_ids, attention_mask, length)
        size = self.bucket(rows)
        model = self.model
        self._forget_stale_graphs(model)
        cache.check_model(model.config, self.model_dtype)
        # The rows the step overwrites in place are copied aside inside the recorded step (`_recorded`):
        # one graph launch instead of a host launch per state tensor.
        with cache.transaction(rows, length, attention_mask, copy_rows=False) as step:
            prev, counts = step.prev, step.counts
            self.steps_seen = cache.steps_started
            # Changed table entries land before the step reads them; a table that moved (another
            # device) invalidates the graphs recorded against its old address.
            ptrs = {name: t.data_ptr() for name, t in device_tables(cache.tables, size, self.device).items()}
            # Rows that drafted fewer tokens than the step are left-padded: a graph of their own moves their pads
            # (steps without pads skip that work).
            padded = length > 1 and any(c < length for c in counts)
            shape = (size, length, self.reach_bucket(max(p + c for p, c in zip(prev, counts))), padded)
            entry = self._bucket_for(shape, ptrs, lambda: self._new_bucket(*shape, ptrs))
            self._fill(entry, prev, counts, input_ids, position_ids)
            columns = slice(None) if keeps_last_column(length) else slice(length - taken, None)
            return self._run(entry, step)[:rows, columns].clone()

    def mixed_step(self, prefill_ids: torch.Tensor, counts: list[int], decode_ids: torch.Tensor) -> torch.Tensor:
        """One step of the first rows' prefill chunks and every other row's next token, replayed from one graph (a
        grouped step, `hf_qsa_cache.grouped`, of two groups): ``prefill_ids`` ``[P, L]`` (row ``i``'s ``counts[i]``
        real tokens in its last columns; ``P`` x ``L`` a short prefill step's shape, `short_prefill_length`),
        ``decode_ids`` ``[D]`` (rows ``P .. P + D``, the cache's last). Returns logits ``[P + D, vocab]``: each
        prefill row's last column, then each decoding row's token."""
        cache = self.cache
        (prefill_rows, length), decoding = prefill_ids.shape, decode_ids.shape[0]
        rows = prefill_rows + decoding
        if rows != cache.num_rows or short_prefill_length(cache, prefill_rows, length) != length or decoding < 1:
            raise ValueError(f"a mixed step takes {prefill_rows} prefill rows of {length} tokens (a short prefill "
                             f"step's shape) and the cache's other {cache.num_rows - prefill_rows} rows one token "
                             f"each; got {decoding} decoding rows")
        size = prefill_rows + min(self.bucket(decoding), cache.max_batch_size - prefill_rows)
        model = self.model
        self._forget_stale_graphs(model)
        cache.check_model(model.config, self.model_dtype)
        with cache.transaction(rows, length, None, copy_rows=False, counts=list(counts) + [1] * decoding) as step:
            prev, counts = step.prev, step.counts
            self.steps_seen = cache.steps_started
            ptrs = {name: t.data_ptr() for name, t in device_tables(cache.tables, size, self.device).items()}
            padded = any(c < length for c in counts[:prefill_rows])
            shape = ("mixed", prefill_rows, length, size, self.reach_bucket(max(p + c for p, c in zip(prev, counts))),
                     padded)
            entry = self._bucket_for(shape, ptrs, lambda: self._new_mixed_bucket(prefill_rows, length, size, shape[4],
                                                                                  padded, ptrs))
            lengths = np.zeros((2, size), dtype=np.int32)  # padding rows: no real token, nothing written
            lengths[0, :rows], lengths[1, :rows] = prev, counts
            entry.lengths.copy_(torch.from_numpy(lengths), non_blocking=True)
            split = prefill_rows * length
            entry.ids[0, :split].copy_(prefill_ids.reshape(-1))
            entry.ids[0, split:split + decoding].copy_(decode_ids)
            return self._run(entry, step)[:rows].clone()

    def _bucket_for(self, shape: tuple, ptrs: dict[str, int], new) -> _Bucket:
        """The step of ``shape`` (``new()`` makes it the first time); a device table that moved (another device)
        invalidates every graph recorded against its old address."""
        entry = self.buckets.get(shape)
        if entry is not None and entry.table_ptrs != ptrs:
            self.buckets.clear()
            entry = None
        if entry is None:
            entry = self.buckets[shape] = new()
        return entry

    def _run(self, entry: _Bucket, step) -> torch.Tensor:
        """The filled step ``entry``: its graph replayed, else run on the recorded path (and recorded), else eagerly
        on that path; returns the logits buffer (the caller copies its rows out)."""
        if entry.graph is not None:
            entry.graph.replay()  # a launch runs whole (its copy included) or raises before running
            self.replays += 1
            step.rows_saved(entry.rows)
            return entry.logits
        if self.record and not entry.eager:
            started = time.perf_counter()
            logits = self._run_and_capture(entry)
            self.recordings += 1
            self.recording_s += time.perf_counter() - started
            return logits
        return self._eager(entry)

    def _forget_stale_graphs(self, model) -> None:
        """Drop the graphs if the weights they read moved, the model gained or lost hooks, or other experts
        were chosen (`set_experts_implementation`: a graph keeps the experts it recorded).

        Every step compares a cheap probe (`_probe`); the first step after any step this runner did not
        take (a prefill, another generate() call, a reset) compares every weight, buffer and hook count
        (a full walk costs milliseconds of host time at the released depths, too much for every step),
        so a hook added deep inside a block between two graphed steps is seen at the next such step.
        """
        own = experts_family(self.expert_configs)
        if own != self.experts_own:  # other experts chosen since
            self.buckets.clear()
            self.experts_own = own
        probe = _probe(model)
        if probe == self.probe and self.steps_seen == self.cache.steps_started:
            return
        state = model_fingerprint(model)
        if probe != self.probe or state != self.model_state:
            self.buckets.clear()
            self._set_experts(experts_modules(model))
        self.probe, self.model_state, self.model_dtype = probe, state, model.dtype

    def steps_were_own(self) -> None:
        """The steps the cache took since this runner's last one were its caller's own eager steps (the serving
        loop's prefill steps), with no user code run in between: the next step checks the cheap probe alone, not
        every weight (`_forget_stale_graphs`: a walk of milliseconds at the released depths, after every such
        step)."""
        self.steps_seen = self.cache.steps_started

    def _set_experts(self, experts: list) -> None:
        self.experts = experts
        self.expert_configs = list({id(config): config for _, config in experts}.values())
        self.experts_own = experts_family(self.expert_configs)  # what the recorded steps' experts started from

    # ------------------------------------------------------------------ internals
    def _new_bucket(self, size: int, length: int, reach: int, padded: bool, ptrs: dict[str, int]) -> _Bucket:
        model = self.model
        uses_positions = getattr(model, "_decode_uses_position_ids", False)
        experts = graph_experts(model, self.experts, self.device, size * length)
        key = capture_key(model, self.experts, self.device, experts, size, length, padded)
        return _Bucket(
            ids=torch.zeros(size, length, dtype=torch.int64, device=self.device), reach=reach,
            lengths=torch.zeros(2, size, dtype=torch.int32, device=self.device),
            positions=torch.zeros(3, size, length, dtype=torch.int64, device=self.device) if uses_positions else None,
            table_ptrs=ptrs, experts=experts, key=key, eager=key in capture_failures(model), padded=padded,
        )

    def _new_mixed_bucket(self, prefill_rows: int, length: int, size: int, reach: int, padded: bool,
                          ptrs: dict[str, int]) -> _Bucket:
        model = self.model
        tokens = prefill_rows * length + size - prefill_rows
        experts = graph_experts(model, self.experts, self.device, tokens)
        key = capture_key(model, self.experts, self.device, experts, ("mixed", prefill_rows, size), length, padded)
        keep = [(i + 1) * length - 1 for i in range(prefill_rows)] + list(range(prefill_rows * length, tokens))
        return _Bucket(
            ids=torch.zeros(1, tokens, dtype=torch.int64, device=self.device), reach=reach,
            lengths=torch.zeros(2, size, dtype=torch.int32, device=self.device), positions=None,
            table_ptrs=ptrs, experts=experts, key=key, eager=key in capture_failures(model), padded=padded,
            prefill_rows=prefill_rows, length=length, keep=torch.tensor(keep, device=self.device),
        )

    def _fill(self, entry: _Bucket, prev: list[int], counts: list[int], input_ids, position_ids) -> None:
        (rows, length), size = input_ids.shape, entry.ids.shape[0]
        lengths = np.zeros((2, size), dtype=np.int32)  # padding rows: no real token, nothing written
        lengths[0, :rows], lengths[1, :rows] = prev, counts
        entry.lengths.copy_(torch.from_numpy(lengths), non_blocking=True)
        entry.ids[:rows].copy_(input_ids)
        if entry.positions is not None:
            if position_ids is None:  # a row's real tokens are its last `count` columns, after its length
                start = lengths[0, :rows] + lengths[1, :rows] - length + np.asarray(self.cache.rope_deltas[:rows])
                steps = start[:, None].astype(np.int64) + np.arange(length)
                entry.positions[:, :rows].copy_(torch.from_numpy(steps), non_blocking=True)  # (each of the 3 axes)
            else:  # the step's columns of what the caller passed, as the eager forward reads them
                entry.positions[:, :rows].copy_(self.model.step_positions(position_ids, rows, length))

    def _recorded(self, entry: _Bucket, tables: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """What a graph records: the rows the step overwrites in place copied aside, then the step."""
        self.cache.copy_rows_aside(entry.rows)
        return self._body(entry, tables)

    def _eager(self, entry: _Bucket) -> torch.Tensor:
        """The recorded step run eagerly; the transaction learns of the copy once it has run."""
        self.cache.copy_rows_aside(entry.rows)
        self.cache.open_step.rows_saved(entry.rows)
        return self._body(entry)

    def _body(self, entry: _Bucket, tables: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The step proper: metadata from the static buffers, then every layer (experts as `graph_experts`
        chose for this bucket)."""
        if entry.prefill_rows:
            return self._mixed_body(entry, tables)
        meta = self.cache.graph_step_metadata(entry.lengths, entry.ids.shape[1], tables, reach=entry.reach,
                                              padded=entry.padded)
        self.cache.log_tokens(meta, entry.ids)
        keep = 1 if keeps_last_column(entry.ids.shape[1]) else 0
        with experts_running(self.experts, entry.experts):
            return self.model._decode_logits(entry.ids, entry.positions, meta, self.cache, keep)

    def _mixed_body(self, entry: _Bucket, tables: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """A mixed step proper: each group's metadata from its rows of the static buffers (the decoding rows'
        group numbered from its first cache row, `StepMetadata.row_offset`), then every layer as a grouped step."""
        cache, split = self.cache, entry.prefill_rows
        tables = device_tables(cache.tables, entry.rows, self.device) if tables is None else tables
        groups = [RowGroup(0, split, entry.length), RowGroup(split, entry.rows - split, 1)]
        metas = []
        for group in groups:
            rows = slice(group.first, group.first + group.rows)
            meta = cache.graph_step_metadata(entry.lengths[:, rows], group.query_len,
                                             {name: t[rows] for name, t in tables.items()}, reach=entry.reach,
                                             padded=entry.padded and group.query_len > 1)
            meta.row_offset = group.first
            metas.append(meta)
        cache.metadata.set(metas[0], self.device)  # (as an eager grouped step sets it)
        for meta, ids in zip(metas, group_ids(entry.ids, groups)):
            cache.log_tokens(meta, ids)
        with experts_running(self.experts, entry.experts):
            return self.model._grouped_logits(entry.ids, group_parts(metas, groups), cache, entry.keep)

    def _run_and_capture(self, entry: _Bucket) -> torch.Tensor:
        logits = self._warm_up(entry)
        try:
            entry.graph, entry.logits = self._capture(entry)
        except Exception as error:  # this step already ran above; the bucket stays eager
            entry.eager, entry.graph, entry.logits = True, None, None
            remember_capture_failure(self.model, entry.key, error)
        return logits

    def _warm_up(self, entry: _Bucket) -> torch.Tensor:
        """This step itself, eagerly and on the path the graph records (on a side stream, where capture
        wants its kernels' first use). Its state writes are the step's."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            logits = self._eager(entry).clone()
        current.wait_stream(side)
        return logits

    def _capture(self, entry: _Bucket) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(graph, the logits buffer each replay writes). Capture records launches without running them:
        the state is not written twice."""
        graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(graph, pool=self.pool):
            logits = self._recorded(entry)
        return graph, logits


def decode_graphs_for(model, cache, input_ids, inputs_embeds, extra_outputs: bool,
                      logits_to_keep=0) -> DecodeGraphs | None:
    """The graphs to run this forward with, or None when it must run eagerly: a step `takes_graph_step` allows,
    of a model held whole on one CUDA device (no offloading hooks), its inputs there, outside another capture."""
    if (not takes_graph_step(cache, input_ids, inputs_embeds, extra_outputs, logits_to_keep)
            or not input_ids.is_cuda or torch.cuda.is_current_stream_capturing()):
        return None
    device = graphs_device(model)
    if device is None or device != input_ids.device:
        return None
    return graphs_of(model, cache, device)


def recorded_steps(model, cache: QSAPagedCache) -> DecodeGraphs:
    """The recorded steps of ``model`` on ``cache``, on the device `graphs_device` names (the serving loop's mixed
    steps, which it plans only where that device exists)."""
    return graphs_of(model, cache, graphs_device(model))


def graphs_device(model) -> torch.device | None:
    """The device ``model``'s recorded steps replay on, or None where every step of it runs eagerly: graphs turned
    off (``model.use_cuda_graphs = False``, ``HF_QSA_CUDA_GRAPHS=0``), or the model not held whole on one CUDA
    device."""
    if not (getattr(model, "use_cuda_graphs", True) and enabled_by_default()):
        return None
    return _single_cuda_device(model)


def takes_graph_step(cache, input_ids, inputs_embeds, extra_outputs: bool, logits_to_keep=0) -> bool:
    """Whether a forward is a step the recorded step computes, whatever the device: token ids, without gradients
    or per-layer outputs, on a `QSAPagedCache` that holds tokens, of a length `recorded_length` takes; a
    prefill-sized one only when its caller keeps the last column's logits alone (``logits_to_keep=1``, as the
    serving loop and generate()'s prefill do: `keeps_last_column`)."""
    if (input_ids is None or inputs_embeds is not None or input_ids.dim() != 2
            or extra_outputs or torch.is_grad_enabled()):
        return False
    return takes_graph_shape(cache, input_ids.shape[0], input_ids.shape[1], logits_to_keep)


def takes_graph_shape(cache, rows: int, length: int, logits_to_keep=0) -> bool:
    """`takes_graph_step`'s part that the step's shape decides (what a scheduler asks before it plans a step)."""
    if not isinstance(cache, QSAPagedCache) or cache.columns_seen == 0:
        return False
    recorded = recorded_length(cache, rows, length)
    if recorded is None:
        return False
    return not keeps_last_column(recorded) or (type(logits_to_keep) is int and logits_to_keep == 1)


def keeps_last_column(length: int) -> bool:
    """Whether the recorded step of ``length`` columns is a prefill step (at least ``SHORT_PREFILL_MIN_LEN``; decode
    and verify steps are at most ``MAX_STEP_LEN``), whose graph computes the last column's logits alone: a buffer
    of every column would hold rows x length x vocabulary (78 MB at 256 columns of a 151,936-token vocabulary, per
    recorded shape)."""
    return length >= SHORT_PREFILL_MIN_LEN


def recorded_length(cache: QSAPagedCache, rows: int, length: int) -> int | None:
    """The length of the recorded step that takes a step of ``rows`` x ``length`` tokens, or None if none does:
    a decode step (one token a row) or a verify step (up to ``num_speculative_tokens + 1`` tokens, at most
    ``MAX_STEP_LEN``; rows that drafted fewer are left-padded) over all the rows, at its own length; else a short
    prefill step (`short_prefill_length`)."""
    if 1 <= length <= min(getattr(cache, "num_speculative_tokens", 0) + 1, MAX_STEP_LEN):
        return length if rows == cache.num_rows else None
    return short_prefill_length(cache, rows, length)


def short_prefill_length(cache: QSAPagedCache, rows: int, length: int) -> int | None:
    """The recorded length of a short prefill step of the first ``rows`` rows, ``length`` tokens each at most:
    ``length`` rounded up to a power of two, at least ``SHORT_PREFILL_MIN_LEN``, if ``rows`` times that is at
    most ``SHORT_PREFILL_TOKENS``; else None. ``rows`` must be a power of two (the graph's rows are then exactly
    the step's: a rows bucket larger than the step would take live rows after it as its padding rows). The recorded
    step continues each row's state, so a row that has not started takes it only where continuous batching placed it
    (`QSAPagedCache.move_rows` gives a new row the state a fresh row starts from: zero recurrent state and conv
    windows, an eos-filled n-gram context, no blocks); elsewhere a row's first tokens take the eager prefill."""
    padded = max(SHORT_PREFILL_MIN_LEN, 1 << max(0, length - 1).bit_length())
    if rows < 1 or rows & (rows - 1) or rows * padded > SHORT_PREFILL_TOKENS or rows > cache.num_rows:
        return None
    return padded if cache.rows.managed or 0 not in cache.lengths[:rows] else None


def left_padded(input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                length: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A step's ``input_ids`` ``[B, L]``, ``position_ids`` (last dim: columns) and ``attention_mask`` (its last
    ``L`` columns the step's) with ``length - L`` pad columns put in front of the step's columns (id 0, mask 0,
    the first column's positions): what a row with fewer tokens than its step has."""
    rows, taken = input_ids.shape
    pads = length - taken
    ids = torch.cat([input_ids.new_zeros(rows, pads), input_ids], dim=1)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = torch.cat([attention_mask[:, :-taken], attention_mask.new_zeros(rows, pads), attention_mask[:, -taken:]],
                     dim=1)
    if position_ids is not None:
        steps = position_ids[..., -taken:]
        position_ids = torch.cat([steps[..., :1].expand(*steps.shape[:-1], pads), steps], dim=-1)
    return ids, position_ids, mask


def graphs_of(model, cache: QSAPagedCache, device, record: bool = True) -> DecodeGraphs:
    """The `DecodeGraphs` of this (model, cache) pair, kept on the cache while the model lives."""
    runner = cache.graph_runners.get(model)
    if runner is None or runner.record != record:
        runner = cache.graph_runners[model] = DecodeGraphs(model, cache, device, record)
    return runner




def _single_cuda_device(model) -> torch.device | None:
    """The one CUDA device holding all of ``model`` (checked again when its weights move), else None."""
    probe = _probe(model)
    if model.__dict__.get("_graph_checked_on") != probe:
        model.__dict__["_graph_checked_on"] = probe
        devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
        hooked = any(hasattr(m, "_hf_hook") for m in model.modules())
        one = len(devices) == 1 and next(iter(devices)).type == "cuda" and not hooked
        model.__dict__["_graph_device"] = canonical_device(next(iter(devices))) if one else None
    return model.__dict__["_graph_device"]

