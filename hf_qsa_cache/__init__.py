"""Paged QSA / short-conv caches for transformers generate()."""

from .cache import QSAPagedCache

__all__ = ["QSAPagedCache"]
