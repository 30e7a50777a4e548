"""Paged QSA / short-conv caches for transformers generate()."""

import os

# Triton times every configuration of an autotuned kernel (flash-linear-attention's GatedDeltaNet
# kernels have dozens) again in each new process: tens of seconds before a first token. Keep its
# choice on disk beside the compiled kernels (Triton's own cache, keyed by kernel source, GPU and
# tuning key). Read when a kernel is defined, so it is set here, before the models import any;
# a user's own setting (``TRITON_CACHE_AUTOTUNING=0``) wins.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

from .cache import QSAPagedCache  # noqa: E402

__all__ = ["QSAPagedCache"]
