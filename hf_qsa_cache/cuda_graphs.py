"""Decode and verify steps replayed from captured CUDA graphs.

A decode step of a small batch is launch-bound: hundreds of small kernels per layer, a few
microseconds of GPU work each. `DecodeGraphs` captures the whole step (metadata kernel, every
layer, the LM head) once per (batch-size bucket, step length) and replays it. Step lengths are 1
(decode) and, on a cache with ``num_speculative_tokens = k``, up to ``min(k + 1, MAX_STEP_LEN)``
(verifying drafts).
Everything the step reads lives in static device buffers updated in place before a replay:

* ``ids`` ``[bucket, L]``, ``lengths`` ``[2, bucket]`` (each row's length before the step, and its
  real tokens in it: L, or 0 for the bucket's padding rows), ``positions`` ``[3, bucket, L]``;
* the cache's persistent block tables (`BlockTable.device_table` writes only changed entries);
* the stores themselves (paged K/V, rings, per-row state), whose addresses never change.

The host part of a step is the cache's usual validation and block reservation (``transaction``):
work per row, no device sync for decode (a verify step reads its mask once). Shapes that would grow with context are sized for the cache's
capacity (`QSAPagedCache.graph_step_metadata`), so one graph serves a whole generation.

A bucket's first step runs eagerly (which also compiles and tunes kernels) on exactly the path the
graph records, then the graph is captured; later steps replay it. If a capture fails (a module that
syncs with the host, say), that bucket runs eagerly from then on, with one warning. Graphs belong
to one (cache, model) pair and stay valid across `QSAPagedCache.reset()`.

Off with ``HF_QSA_CUDA_GRAPHS=0`` in the environment or ``model.use_cuda_graphs = False``.
"""

from __future__ import annotations

import os
import traceback
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from .cache import QSAPagedCache


# Longest verify step that gets graphs (one per length and bucket); longer ones run eagerly.
MAX_STEP_LEN = 8


def enabled_by_default() -> bool:
    return os.environ.get("HF_QSA_CUDA_GRAPHS", "1") != "0"


@dataclass
class _Bucket:
    ids: torch.Tensor  # [bucket, L] int64
    lengths: torch.Tensor  # [2, bucket] int32
    positions: torch.Tensor | None  # [3, bucket, L] int64 (models with position ids)
    table_ptrs: dict[str, int]  # device-table addresses the step reads
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [bucket, L, vocab], written by each replay
    eager: bool = False  # capture failed: run the static-buffer step eagerly


class DecodeGraphs:
    """The captured decode steps of one model on one cache, by batch-size bucket.

    ``record=False`` runs the same static-buffer step eagerly instead of replaying a graph (the CPU
    tests use it to check that path against the ordinary forward).
    """

    def __init__(self, model, cache: QSAPagedCache, device: torch.device, record: bool = True):
        # Held weakly: the cache keeps runners per model, and must not keep a deleted model alive.
        self._model = weakref.ref(model)
        self.cache = cache
        self.device = torch.device(device)
        self.record = record
        self.pool = torch.cuda.graph_pool_handle() if record and self.device.type == "cuda" else None
        self.buckets: dict[tuple[int, int], _Bucket] = {}  # (rows bucket, step length) -> buffers, graph
        self.model_state = model_fingerprint(model)  # what the recorded graphs read (checked at replay)
        self.probe = _probe(model)  # the cheap part of that check, done every step
        self.steps_seen = -1  # cache.steps_started when this runner last opened a step

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise RuntimeError("the model of these CUDA graphs was deleted")
        return model

    def bucket(self, rows: int) -> int:
        """Powers of two up to the cache's row count: few graphs, little padding."""
        return min(1 << max(0, rows - 1).bit_length(), self.cache.max_batch_size)

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
             attention_mask: torch.Tensor | None) -> torch.Tensor:
        """One step of ``input_ids`` ``[B, L]``; returns logits ``[B, L, vocab]``."""
        cache = self.cache
        rows, length = input_ids.shape
        size = self.bucket(rows)
        model = self.model
        cache.check_model(model.config, model.dtype)
        self._forget_stale_graphs(model)
        # The rows the step overwrites in place are copied aside inside the recorded step (`_recorded`):
        # one graph launch instead of a host launch per state tensor.
        with cache.transaction(rows, length, attention_mask, copy_rows=False) as (prev, counts):
            self.steps_seen = cache.steps_started
            # Changed table entries land before the step reads them; a table that moved (another
            # device) invalidates the graphs recorded against its old address.
            ptrs = {n: t.device_table(size, self.device).data_ptr() for n, t in cache.tables.items()}
            entry = self.buckets.get((size, length))
            if entry is not None and entry.table_ptrs != ptrs:
                self.buckets.clear()
                entry = None
            if entry is None:
                entry = self.buckets[(size, length)] = self._new_bucket(size, length, ptrs)
            self._fill(entry, prev, counts, input_ids, position_ids)
            try:
                if entry.graph is not None:
                    entry.graph.replay()  # a launch runs whole (its copy included) or raises before running
                    cache.rows_copied_aside(size)
                    logits = entry.logits[:rows].clone()
                elif self.record and not entry.eager:
                    logits = self._run_and_capture(entry)[:rows].clone()
                else:
                    logits = self._eager(entry)[:rows].clone()
            finally:
                cache.clear_step_metadata()
        return logits

    def _forget_stale_graphs(self, model) -> None:
        """Drop the graphs if the weights they read moved or the model gained or lost hooks.

        Every step compares a cheap probe (`_probe`); the first step after any step this runner did not
        take (a prefill, another generate() call, a reset) compares every weight, buffer and hook count
        (a full walk costs milliseconds of host time at the released depths, too much for every step),
        so a hook added deep inside a block between two graphed steps is seen at the next such step.
        """
        probe = _probe(model)
        if probe == self.probe and self.steps_seen == self.cache.steps_started:
            return
        state = model_fingerprint(model)
        if probe != self.probe or state != self.model_state:
            self.buckets.clear()
        self.probe, self.model_state = probe, state

    # ------------------------------------------------------------------ internals
    def _new_bucket(self, size: int, length: int, ptrs: dict[str, int]) -> _Bucket:
        uses_positions = getattr(self.model, "_decode_uses_position_ids", False)
        return _Bucket(
            ids=torch.zeros(size, length, dtype=torch.int64, device=self.device),
            lengths=torch.zeros(2, size, dtype=torch.int32, device=self.device),
            positions=torch.zeros(3, size, length, dtype=torch.int64, device=self.device) if uses_positions else None,
            table_ptrs=ptrs,
        )

    def _fill(self, entry: _Bucket, prev: list[int], counts: list[int], input_ids, position_ids) -> None:
        (rows, length), size = input_ids.shape, entry.ids.shape[0]
        pad = [0] * (size - rows)  # padding rows: no real token, nothing written
        entry.lengths.copy_(torch.tensor([prev + pad, counts + pad], dtype=torch.int32), non_blocking=True)
        entry.ids[:rows].copy_(input_ids)
        if entry.positions is not None:
            if position_ids is None:  # rows have started, so a step has no pads: positions follow the length
                start = [p + d for p, d in zip(prev, self.cache.rope_deltas)]  # (plus a row's multimodal offset)
                steps = torch.tensor(start, dtype=torch.int64)[:, None] + torch.arange(length)
                entry.positions[:, :rows] = steps.to(self.device, non_blocking=True)
            else:  # the step's columns of what the caller passed, as the eager forward reads them
                entry.positions[:, :rows].copy_(self.model.step_positions(position_ids, rows, length))

    def _recorded(self, entry: _Bucket, tables: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """What a graph records: the rows the step overwrites in place copied aside, then the step."""
        self.cache.copy_rows_aside(entry.ids.shape[0])
        return self._body(entry, tables)

    def _eager(self, entry: _Bucket) -> torch.Tensor:
        """The recorded step run eagerly; the transaction learns of the copy once it has run."""
        self.cache.copy_rows_aside(entry.ids.shape[0])
        self.cache.rows_copied_aside(entry.ids.shape[0])
        return self._body(entry)

    def _body(self, entry: _Bucket, tables: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The step proper: metadata from the static buffers, then every layer."""
        meta = self.cache.graph_step_metadata(entry.lengths, entry.ids.shape[1], tables)
        self.cache.log_tokens(meta, entry.ids)
        return self.model._decode_logits(entry.ids, entry.positions, meta, self.cache)

    def _run_and_capture(self, entry: _Bucket) -> torch.Tensor:
        # This step itself, eagerly and on the path the graph records (on a side stream, where capture
        # wants its kernels' first use). Its state writes are the step's.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            logits = self._eager(entry).clone()
        current.wait_stream(side)
        # Capture records launches without running them: the state is not written twice.
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                entry.logits = self._recorded(entry)
        except Exception as error:  # this step already ran above; the bucket stays eager
            entry.eager, entry.logits = True, None
            where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                              for f in traceback.extract_tb(error.__traceback__)[-4:])
            warnings.warn(f"CUDA graph capture failed, decode runs eagerly for this batch size: {error} "
                          f"(at {where})", stacklevel=4)
            return logits
        entry.graph = graph
        return logits


def decode_graphs_for(model, cache, input_ids, inputs_embeds, extra_outputs: bool) -> DecodeGraphs | None:
    """The graphs to run this forward with, or None when it must run eagerly.

    Graphs serve decode steps (one token per row) and verify steps (up to ``num_speculative_tokens + 1``
    tokens, at most ``MAX_STEP_LEN``) of a model held whole on one CUDA device (no offloading hooks),
    without gradients or per-layer outputs, on a `QSAPagedCache` whose rows have all started.
    """
    if not (getattr(model, "use_cuda_graphs", True) and enabled_by_default()):
        return None
    if (input_ids is None or inputs_embeds is not None or input_ids.dim() != 2
            or not 1 <= input_ids.shape[1] <= min(getattr(cache, "num_speculative_tokens", 0) + 1, MAX_STEP_LEN)
            or extra_outputs or torch.is_grad_enabled() or not isinstance(cache, QSAPagedCache)
            or not input_ids.is_cuda or cache.columns_seen == 0 or input_ids.shape[0] != cache.num_rows
            or torch.cuda.is_current_stream_capturing()):
        return None
    device = _single_cuda_device(model)
    if device is None or device != input_ids.device:
        return None
    return graphs_of(model, cache, device)


def graphs_of(model, cache: QSAPagedCache, device, record: bool = True) -> DecodeGraphs:
    """The `DecodeGraphs` of this (model, cache) pair, kept on the cache while the model lives."""
    runner = cache.graph_runners.get(model)
    if runner is None or runner.record != record:
        runner = cache.graph_runners[model] = DecodeGraphs(model, cache, device, record)
    return runner


# Parameters or buffers registered anywhere since import (a replaced weight, an added adapter). Module
# registrations are not counted: slicing an nn.ModuleList registers its modules anew on every forward.
_registrations = [0]


def _count_registration(*args) -> None:
    _registrations[0] += 1


for _register in (torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook):
    _register(_count_registration)


def _probe(model) -> tuple:
    """The cheap per-step part of `model_fingerprint`: registrations anywhere, the first and last weight's
    address, and the hooks of the model and of its blocks (members of a ModuleList: the decoder layers)."""
    cached = model.__dict__.get("_graph_probe")
    if cached is None:
        params = list(model.parameters())
        blocks = [model] + [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]
        cached = model.__dict__["_graph_probe"] = ((params[0], params[-1]), blocks)
    params, blocks = cached
    return (_registrations[0], *(p.data_ptr() for p in params),
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in blocks))


def model_fingerprint(model) -> tuple:
    """Where every weight and buffer lives, and how many hooks the modules carry: a recorded graph reads
    the first and bypasses the second, so it is valid only while both stay as they were at capture."""
    modules = list(model.modules())
    return (
        tuple(t.data_ptr() for m in modules for t in (*m._parameters.values(), *m._buffers.values())
              if t is not None),
        tuple(len(m._forward_hooks) + len(m._forward_pre_hooks) + hasattr(m, "_hf_hook") for m in modules),
    )


def _single_cuda_device(model) -> torch.device | None:
    """The one CUDA device holding all of ``model`` (checked again when its weights move), else None."""
    probe = _probe(model)
    if model.__dict__.get("_graph_checked_on") != probe:
        model.__dict__["_graph_checked_on"] = probe
        devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
        hooked = any(hasattr(m, "_hf_hook") for m in model.modules())
        one = len(devices) == 1 and next(iter(devices)).type == "cuda" and not hooked
        model.__dict__["_graph_device"] = _canonical_cuda(next(iter(devices))) if one else None
    return model.__dict__["_graph_device"]


def _canonical_cuda(device: torch.device) -> torch.device:
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
