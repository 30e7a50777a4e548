"""Drop-in Qwen4Exp and Inkling modeling on `QSAPagedCache`."""

from .modeling_qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextModel

__all__ = ["Qwen4ExpForCausalLM", "Qwen4ExpTextModel"]

try:  # the Inkling file lands separately
    from .modeling_inkling import InklingForCausalLM, InklingTextModel  # noqa: F401

    __all__ += ["InklingForCausalLM", "InklingTextModel"]
except ImportError:
    pass
