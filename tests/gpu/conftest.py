"""The GPU checks: kernels against their torch specification at the benchmark shapes, and whole models on the
CUDA path against transformers. Every test here is marked ``gpu`` and skipped where no CUDA device is visible:

    python -m pytest -m gpu -n 0 tests/gpu
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# The benchmark scripts whose shapes and comparisons these tests share (`bench_generate`'s configs,
# `check_fused_kernels`' cases, ...), importable by name as the scripts import each other.
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)
# The CPU model tests whose builders the model checks reuse (`test_training`, `test_multimodal_*`).
MODEL_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if MODEL_TESTS not in sys.path:
    sys.path.append(MODEL_TESTS)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fp32_means_fp32():
    """No TF32 in fp32 matmuls and convolutions (the comparisons' bounds are fp32's), restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(autouse=True)
def _fp32_and_cpu_tensors_run_the_torch_gated_delta_rule(monkeypatch):
    """Where flash-linear-attention is installed, transformers binds its Triton kernels (GatedDeltaNet's chunked
    and recurrent rules) at import, for every device and dtype, and our models call them through transformers'
    module. Two things follow: the references here, transformers' models on the CPU, hand them CPU tensors,
    which Triton refuses; and its kernels take fp32 inputs through TF32 dots (a 10-bit mantissa), which the fp32 bounds
    here are not made for. So CPU and fp32 tensors run the torch function each kernel wraps; bf16 tensors on
    CUDA (the bf16 tests, the benchmarks' dtype) keep the kernel."""
    import transformers.models.inkling.modeling_inkling as inkling
    import transformers.models.qwen4_exp.modeling_qwen4_exp as qwen4_exp

    for module in (qwen4_exp, inkling):
        for name, fn in list(vars(module).items()):
            reference = getattr(fn, "__wrapped__", None)
            if callable(fn) and reference is not None and getattr(fn, "__module__", None) == module.__name__:
                monkeypatch.setattr(module, name, _by_device(fn, reference))


def _by_device(kernel, reference):
    def run(*args, **kwargs):
        first = next(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))
        return (kernel if first.is_cuda and first.dtype != torch.float32 else reference)(*args, **kwargs)

    return run
