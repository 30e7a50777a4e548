"""Per-forward step metadata (`hf_qsa_cache.ops.metadata_ref`, where the ops that read it live), under its
package-level name: `StepMetadata`, `QSAGeometry`, the specification `build_step_metadata_torch` and its helpers."""

from __future__ import annotations

from .ops.metadata_ref import QSAGeometry, StepMetadata, build_step_metadata_torch, host_fields, max_compress_work

__all__ = ["QSAGeometry", "StepMetadata", "build_step_metadata_torch", "host_fields", "max_compress_work"]
