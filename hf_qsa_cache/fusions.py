"""The fused decode kernels by name, and a way to switch them at runtime: the registry of
`hf_qsa_cache.ops.fusions` (it lives with the ops, which read it) under its public name.

``HF_QSA_FUSED`` (parsed once, at import) sets the switches: unset, the default set; ``all``; ``none`` (or
empty); a comma list (``default`` in it stands for the default set); an unknown name is refused.
`enabled(name)` reads a switch, `fused(names, on)` switches some for a block of code, `active()` names those on.
"""

from __future__ import annotations

from .ops.fusions import FUSIONS, STATE, active, enabled, fused, requested

__all__ = ["FUSIONS", "STATE", "active", "enabled", "fused", "requested"]
