"""The fused decode kernels by name: one registry of switches, read by the ops' dispatch functions.

`FUSIONS` names every switch with its default. ``HF_QSA_FUSED`` is parsed once, at import, into `STATE` (the
switches as they are now): unset, the default set (every name whose default is on); ``all`` every name; ``none``
(or empty) none; a comma list only those (``default`` in it stands for the default set: ``default,name`` adds
one to it); an unknown name is refused with a ValueError naming the known ones.

`enabled` is how code reads a switch, when the op runs (a dict lookup: the decode step's host path calls it for
every op of every layer). `fused` switches names for a block of code (a benchmark comparing both paths in one
process, a test); `active` says which are on. A CUDA graph records the path its capture took: switch before
building the cache whose graphs should use the new setting.

``hf_qsa_cache.fusions`` is this module under its public name (the ops sit below the rest of the package, so
the registry they read lives here).
"""

from __future__ import annotations

import contextlib
import os

# name -> on by default. A new fusion starts off by default (on only when named in HF_QSA_FUSED, or with "all"):
# built and tested on the CPU (the kernels under the Triton interpreter) until it is timed against the default
# on a GPU (benchmarks/RESULTS.md keeps the figures).
FUSIONS: dict[str, bool] = {
    "hc": True,  # Qwen4Exp's hyper-connection mixing in three elementwise launches (ops.hyper_connection)
    "hc_proj": True,  # on top of hc: a few tokens' mixing projections inside two launches
    "gdn": True,  # GatedDeltaNet's gates, conv and gated norm (ops.gated_delta)
    "gdn_step": True,  # a one-token GatedDeltaNet recurrence with its gates and norm in one launch
    "norm": True,  # residual add + RMS norm, and Qwen4Exp's q/k norm with the rotary (ops.rms_norm, ops.norm_rope)
    "experts": True,  # graph steps of few tokens run the selected experts' kernels (ops.experts.graph_experts)
    "router": True,  # Qwen4Exp's routing in two launches (ops.router)
    "qsa": True,  # the QSA index arithmetic: group pooling, selected positions (ops.qsa)
    "qsa_topk": True,  # a selection's set of best groups in one launch, no sort (ops.top_set)
    "qsa_writes": True,  # a QSA layer's row writes in one launch (ops.row_writes)
    "qsa_gate": True,  # the output gate in the merge of the sparse attention's splits (ops.qsa)
    "shared_expert": True,  # shared experts inside the routed experts' kernels (ops.experts)
    "inkling_router": True,  # Inkling's routing in one launch (ops.inkling_router)
    "prompt_experts": True,  # prompts' experts through the grouped path (ops.prompt_experts)
    "projections": True,  # a few tokens' projections of one input in one launch (ops.linears)
    "ple": True,  # Qwen4Exp's PLE lookup and gating in one launch each (ops.ple)
    "conv_norm": True,  # Inkling's short conv, residual add and norm in one launch (ops.conv_norm)
    "tiled_experts": True,  # few (token, expert) pairs through the tiled experts' kernels (ops.prompt_experts)
    "rel_bias": True,  # Inkling's decode-step relative bias computed inside the attention kernel
    "token_log": True,  # the token log's write in one launch (ops.token_log)
    # Not a fusion: every kernel launched with programmatic dependent launch (`ops.triton_common.pdl`).
    "pdl": True,
}


def requested(setting: str | None, defaults: dict[str, bool] | None = None) -> set[str]:
    """The names an ``HF_QSA_FUSED`` value turns on, against the table ``defaults`` (`FUSIONS`); refuses unknown
    names."""
    table = FUSIONS if defaults is None else defaults
    default_set = {name for name, on in table.items() if on}
    if setting is None:
        return default_set
    names = {name.strip() for name in setting.split(",") if name.strip()} - {"none"}
    unknown = names - {*table, "all", "default"}
    if unknown:
        raise ValueError(f"HF_QSA_FUSED names unknown fusion(s) {sorted(unknown)}; "
                         f"known: {', '.join(table)}, all, default or none")
    if "all" in names:
        return set(table)
    return names - {"default"} | (default_set if "default" in names else set())


_ON = requested(os.environ.get("HF_QSA_FUSED"))
# name -> whether it is on now (changed only by `fused`, and by tests through pytest's monkeypatch.setitem).
STATE: dict[str, bool] = {name: name in _ON for name in FUSIONS}
del _ON


def enabled(name: str) -> bool:
    """Whether switch ``name`` is on now (a KeyError for a name `FUSIONS` does not hold)."""
    return STATE[name]


def _names(names) -> list[str]:
    names = list(FUSIONS) if "all" in names else list(names)
    unknown = [n for n in names if n not in FUSIONS]
    if unknown:
        raise ValueError(f"unknown fusion(s) {unknown}; known: {sorted(FUSIONS)} or 'all'")
    return names


@contextlib.contextmanager
def fused(names=("all",), on: bool = True):
    """Within the block, the fusions ``names`` (or ``"all"``) are on (``on=False``: off); restored after."""
    names = _names(names)
    saved = {name: STATE[name] for name in names}
    try:
        STATE.update(dict.fromkeys(names, bool(on)))
        yield
    finally:
        STATE.update(saved)


def active() -> str:
    """The fusions on now, comma-separated in `FUSIONS` order ("all" when every one is; "none" when none is):
    what a benchmark records beside its figures."""
    names = [name for name in FUSIONS if STATE[name]]
    return "all" if len(names) == len(FUSIONS) else ",".join(names) or "none"
