"""Paged QSA / short-conv caches for transformers generate()."""

import os

# Triton times every configuration of an autotuned kernel (flash-linear-attention's GatedDeltaNet
# kernels have dozens) again in each new process: tens of seconds before a first token. Keep its
# choice on disk beside the compiled kernels (Triton's own cache, keyed by kernel source, GPU and
# tuning key). Read when a kernel is defined, so it is set here, before the models import any;
# a user's own setting (``TRITON_CACHE_AUTOTUNING=0``) wins.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
# Triton 3.9 warns that its default for contracting a multiply and an add into one FMA flips to off in 3.10: the
# kernels here were checked against their torch specifications, and timed, with it on. Keep it on (a user's own
# setting wins), so a Triton upgrade changes neither their rounding nor their speed unannounced.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from .cache import QSAPagedCache  # noqa: E402

__all__ = ["QSAPagedCache"]
