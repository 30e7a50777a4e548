"""Triton kernels used by the cache (each tested against a torch specification)."""
