"""Per-forward step metadata (`hf_qsa_cache.ops.metadata_ref`, where the ops that read it live), under its
package-level name: `StepMetadata`, `QSAGeometry`, the specification `build_step_metadata_torch` and its helpers,
and its form for CPU decode steps, `build_decode_metadata_cpu`."""

from __future__ import annotations

from .ops.metadata_ref import (
    QSAGeometry, StepMetadata, build_decode_metadata_cpu, build_step_metadata_torch, host_fields, is_decode_step,
    max_compress_work,
)

__all__ = ["QSAGeometry", "StepMetadata", "build_decode_metadata_cpu", "build_step_metadata_torch", "host_fields",
           "is_decode_step", "max_compress_work"]
