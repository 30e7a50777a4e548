"""What decides whether a recorded CUDA graph step may be replayed or recorded (`hf_qsa_cache.cuda_graphs`): the
model as the graphs read it (`model_fingerprint`, its cheap per-step part `_probe`), the experts implementation
a step runs, and the shapes that failed to capture on a model (`capture_key`, `capture_failures`)."""

from __future__ import annotations

import contextlib
import gc
import traceback
import warnings
from pathlib import Path

import torch

# Parameters or buffers registered anywhere since import (a replaced weight, an added adapter). Module
# registrations are not counted: slicing an nn.ModuleList registers its modules anew on every forward.
_registrations = [0]


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off until the block ends. A capture must not see it run: objects it
    frees may free CUDA graphs (a user's, another cache's), and destroying a graph while a stream captures is
    an error that invalidates the capture. (Not a collection first: at a few hundred milliseconds a
    collection would cost more than the capture.)"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ----------------------------------------------------------------------------- failed captures
def capture_key(model, experts: list, device: torch.device, substitute: str | None, size: int, length: int,
                padded: bool = False) -> tuple:
    """What decides whether a step of ``size`` rows x ``length`` tokens captures: the device, the weights'
    dtype, the experts implementation the step runs, and the step's shape.

    dtype and experts implementation pick the kernels (fp32 ``grouped_mm`` copies to the host, bf16 on
    Hopper does not), and both can change on a live model (``model.to``, `set_experts_implementation`),
    which gives capture another try. The shape is part of it because kernels are chosen by shape too
    (a verify step runs other attention paths than a decode step): one shape failing must not cost
    the graphs of shapes that capture. Each failing shape is paid once per model and process.
    """
    implementation = substitute or (experts[0][1]._experts_implementation if experts else None)
    return (str(device), model.dtype, implementation, size, length, padded)


def capture_failures(model) -> dict[tuple, str]:
    """The steps that failed to capture on this model (`capture_key` -> the error), for every cache."""
    return model.__dict__.setdefault("_graph_capture_failures", {})


def remember_capture_failure(model, key: tuple, error: BaseException) -> None:
    """Record a failed capture; warn at the model's first failure of this dtype and experts implementation
    (other shapes failing the same way are recorded quietly)."""
    failures = capture_failures(model)
    first = not any(k[:3] == key[:3] for k in failures)
    failures[key] = f"{type(error).__name__}: {error}"
    if first:
        where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                          for f in traceback.extract_tb(error.__traceback__)[-4:])
        warnings.warn(
            f"CUDA graph capture failed ({key[1]}, experts {key[2]}, {key[3]} rows x {key[4]} tokens): {error} "
            f"(at {where}). Such steps of this model run eagerly from now on, on every cache, without "
            "trying to capture again", stacklevel=5)


# ----------------------------------------------------------------------------- experts in graph steps
def experts_modules(model) -> list[tuple[torch.nn.Module, object]]:
    """(experts module, the config whose ``_experts_implementation`` it reads) for each module built by
    transformers' ``use_experts_implementation`` (its experts implementations apply)."""
    return [(m, m.config) for m in model.modules()
            if hasattr(m, "_is_expert_parallel") and hasattr(m, "is_concatenated") and hasattr(m, "config")]


def experts_family(configs: list) -> tuple:
    """The experts implementations these configs name: a recorded step's experts hold while this stays the same
    (each chosen implementation runs as chosen, so another choice drops the recorded steps)."""
    return tuple(sorted({str(c._experts_implementation) for c in configs}))


@contextlib.contextmanager
def experts_running(experts: list, implementation: str | None):
    """Run the experts with ``implementation`` (None: unchanged) inside the block, then restore each
    config's own (on the internal attribute, as transformers' `set_experts_implementation` does)."""
    if implementation is None:
        yield
        return
    configs = list({id(config): config for _, config in experts}.values())
    saved = [config._experts_implementation_internal for config in configs]
    for config in configs:
        config._experts_implementation_internal = implementation
    try:
        yield
    finally:
        for config, value in zip(configs, saved):
            config._experts_implementation_internal = value


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
        hooks = [d for m in blocks for d in (m._forward_hooks, m._forward_pre_hooks)]  # (registering mutates them)
        cached = model.__dict__["_graph_probe"] = (params[0], params[-1], hooks)
    first, last, hooks = cached
    return _registrations[0], first.data_ptr(), last.data_ptr(), sum(map(len, hooks))


def model_fingerprint(model) -> tuple:
    """Where every weight and buffer lives, and how many hooks the modules carry: a recorded graph reads
    the first and bypasses the second, so it is valid only while both stay as they were at capture."""
    modules = list(model.modules())
    return (
        tuple(t.data_ptr() for m in modules for t in (*m._parameters.values(), *m._buffers.values())
              if t is not None),
        tuple(len(m._forward_hooks) + len(m._forward_pre_hooks) + hasattr(m, "_hf_hook") for m in modules),
    )
