"""`kernel_compile`: a launch recorded under the interpreter is compiled as Triton's launcher on the GPU would
compile it. The launcher derives part of the code from the argument values (an integer equal to 1 becomes a
compile-time 1; integers and addresses divisible by 16 are marked), which decides whether a load is one vector
instruction or one per element; a record without it compiled other code than the GPU runs."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import kernel_compile


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["m"])
def _copy_kernel(x_ptr, y_ptr, stride, n, m, scale, flag, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i * stride)
    tl.store(y_ptr + i, x * scale + n + m + flag)


def _launcher_specialisation(*args, **kwargs):
    """What Triton's own launcher derives for ``_copy_kernel(*args, **kwargs)`` (its argument binder, as built
    for a GPU target; nothing is launched)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(_copy_kernel.signature, _copy_kernel.params,
                                            make_backend(GPUTarget("cuda", kernel_compile.TARGET_ARCH, 32)))
    _bound, specialisation, _options = binder(*args, **kwargs)
    return specialisation


def _record(*args, **kwargs) -> dict:
    options = {"do_not_specialize": ["n"], "do_not_specialize_on_alignment": ["m"]}
    return kernel_compile.launch_record(_copy_kernel.fn, _copy_kernel.arg_names, args, kwargs, options)


ARGUMENTS = [  # x, y, stride, n, m, scale, flag
    lambda x, y: (x, y, 1, 1, 32, 0.5, True),  # stride 1: a constant; n (not specialised) stays an argument
    lambda x, y: (x, y, 32, 32, 1, 2.0, False),  # stride 32 and n 32 divisible by 16; m 1 (aligned off) a constant
    lambda x, y: (x[1:], y, 7, 3, 48, 1.0, True),  # an address off the 16-byte grid, an odd stride
]


@pytest.mark.parametrize("make", ARGUMENTS)
def test_a_record_holds_what_the_launcher_derives(make):
    x, y = torch.zeros(1024), torch.zeros(64)
    args = make(x, y)
    record = _record(*args, BLOCK=64)
    expected = _launcher_specialisation(*args, BLOCK=64)
    for name, (kind, attr) in zip(_copy_kernel.arg_names, expected):
        if kind == "constexpr":
            assert record["constants"][name] == attr, name
            assert name not in record["signature"], name
        else:
            assert record["signature"][name] == kind, name
            assert record["attrs"].get(name, "") == (attr or ""), name


def test_the_compiled_code_follows_the_record():
    """A unit stride and 16-byte aligned addresses give vector loads (``ld.global.v4``: 128 elements on one warp,
    4 a thread); an odd stride, one load an element: the specialisation reaches the compiler."""
    x, y = torch.zeros(1024), torch.zeros(128)

    def ptx(*args):
        record = _record(*args, BLOCK=128)
        record["options"] = {"num_warps": 1}
        return kernel_compile.compile_launch(record).asm["ptx"]

    assert "ld.global.v4" in ptx(x, y, 1, 1, 0, 1.0, False)
    assert "ld.global.v4" not in ptx(x, y, 3, 1, 0, 1.0, False)
