"""The fused decode kernels by name, and a way to switch them at runtime.

``HF_QSA_FUSED`` (read at import, `fusion_enabled`) sets each fusion's flag for the process: unset, every
fusion measured on the H200 (exact in fp32 and faster, benchmarks/RESULTS.md), that is all but
`OFF_BY_DEFAULT`; ``all`` adds those; ``none`` (or empty) turns all off; a comma list turns on only those
(``default`` in it stands for the measured ones);
an unknown name is refused at import. `fused` switches them for a block of code (a benchmark comparing
both paths in one process, a test). A flag is read when a forward runs, and a CUDA graph records the
path its capture took: switch before building the cache whose graphs should use the new setting.
"""

from __future__ import annotations

import contextlib
import importlib
import os

# name -> (module, flag): the flag(s) a fusion's name sets (``HF_QSA_FUSED`` picks among them).
FLAGS = {
    "hc": ("hf_qsa_cache.ops.hyper_connection", "FUSED_HC"),
    "hc_proj": ("hf_qsa_cache.ops.hyper_connection", "FUSED_HC_PROJ"),
    "hc_norm_proj": ("hf_qsa_cache.ops.hyper_connection", "FUSED_HC_NORM_PROJ"),
    "gdn": ("hf_qsa_cache.ops.gated_delta", "FUSED_GDN"),
    "gdn_step": ("hf_qsa_cache.ops.gated_delta", "FUSED_GDN_STEP"),
    "norm": [("hf_qsa_cache.ops.rms_norm", "FUSED_NORM"), ("hf_qsa_cache.ops.norm_rope", "FUSED_NORM_ROPE")],
    "experts": ("hf_qsa_cache.cuda_graphs", "FUSED_EXPERTS"),
    "router": ("hf_qsa_cache.ops.router", "FUSED_ROUTER"),
    "qsa": ("hf_qsa_cache.ops.qsa", "FUSED_QSA"),
    "qsa_topk": ("hf_qsa_cache.ops.qsa", "FUSED_QSA_TOPK"),
    "qsa_writes": ("hf_qsa_cache.ops.row_writes", "FUSED_QSA_WRITES"),
    "qsa_gate": ("hf_qsa_cache.ops.qsa", "FUSED_QSA_GATE"),
    # Not a fusion: `qsa_topk`'s kernel finds the k-th largest score by a radix search instead of a bisection.
    "qsa_topk_radix": ("hf_qsa_cache.ops.top_set_triton", "FUSED_RADIX_SEARCH"),
    "shared_expert": ("hf_qsa_cache.ops.experts", "FUSED_SHARED_EXPERT"),
    "inkling_router": ("hf_qsa_cache.ops.inkling_router", "FUSED_INKLING_ROUTER"),
    "prompt_experts": ("hf_qsa_cache.ops.prompt_experts", "FUSED_PROMPT_EXPERTS"),
    "projections": ("hf_qsa_cache.ops.linears", "FUSED_PROJECTIONS"),
    "ple": ("hf_qsa_cache.ops.ple", "FUSED_PLE"),
    "conv_norm": ("hf_qsa_cache.ops.conv_norm", "FUSED_CONV_NORM"),
    "tiled_experts": ("hf_qsa_cache.ops.prompt_experts", "FUSED_TILED_EXPERTS"),
    "rel_bias": ("hf_qsa_cache.ops.inkling_attention", "FUSED_REL_BIAS"),
    "token_log": ("hf_qsa_cache.ops.token_log", "FUSED_TOKEN_LOG"),
    # Not a fusion: every kernel launched with programmatic dependent launch (`ops.triton_common.pdl`).
    "pdl": ("hf_qsa_cache.ops.triton_common", "FUSED_PDL"),
}
# On only when named in HF_QSA_FUSED (or with "all"), not by default: built and tested on the CPU (the kernels under
# the Triton interpreter) but not yet timed against the default on one GPU (a new fusion starts here), or timed
# slower than what they replace (benchmarks/RESULTS.md: a graphed Qwen4Exp 8-layer step at 1 x 16384 on the H200
# with qsa_topk_radix 1.31 against 1.20 ms; the 40-layer step at 1 x 4096 with hc_norm_proj's second form 5.74
# against 4.62 ms).
OFF_BY_DEFAULT: tuple[str, ...] = ("hc_norm_proj", "qsa_topk_radix")


def requested(setting: str | None, off_by_default: tuple[str, ...] = OFF_BY_DEFAULT) -> set[str]:
    """The names an ``HF_QSA_FUSED`` value turns on ("all" stands for every one, "default" for the default set:
    ``default,rel_bias`` adds one to it); refuses unknown names."""
    measured = {name for name in FLAGS if name not in off_by_default}
    if setting is None:
        return measured
    names = {name.strip() for name in setting.split(",") if name.strip()} - {"none"}
    if names - {*FLAGS, "all", "default"}:
        raise ValueError(f"HF_QSA_FUSED names unknown fusion(s) {sorted(names - {*FLAGS, 'all', 'default'})}; "
                         f"known: {', '.join(FLAGS)}, all, default or none")
    return names - {"default"} | (measured if "default" in names else set())


_REQUESTED = requested(os.environ.get("HF_QSA_FUSED"))


def fusion_enabled(name: str) -> bool:
    """Whether ``HF_QSA_FUSED`` turns fusion ``name`` on (each op module sets its flag from it at import)."""
    return name in _REQUESTED or "all" in _REQUESTED


def _places(names) -> list[tuple[object, str]]:
    names = list(FLAGS) if "all" in names else list(names)
    unknown = [n for n in names if n not in FLAGS]
    if unknown:
        raise ValueError(f"unknown fusion(s) {unknown}; known: {sorted(FLAGS)} or 'all'")
    places = []
    for name in names:
        entries = FLAGS[name] if isinstance(FLAGS[name], list) else [FLAGS[name]]
        places += [(importlib.import_module(module), flag) for module, flag in entries]
    return places


@contextlib.contextmanager
def fused(names=("all",), on: bool = True):
    """Within the block, the fusions ``names`` (or ``"all"``) are on (``on=False``: off); restored after."""
    places = _places(names)
    saved = [getattr(module, flag) for module, flag in places]
    try:
        for module, flag in places:
            setattr(module, flag, on)
        yield
    finally:
        for (module, flag), value in zip(places, saved):
            setattr(module, flag, value)


def active() -> str:
    """The fusions on now, comma-separated in `FLAGS` order ("all" when every one is; "none" when none is):
    what a benchmark records beside its figures."""
    names = [name for name in FLAGS if all(getattr(module, flag) for module, flag in _places([name]))]
    return "all" if len(names) == len(FLAGS) else ",".join(names) or "none"
