"""Drop-in Qwen4Exp and Inkling modeling on `QSAPagedCache`."""

from .modeling_inkling import InklingForCausalLM, InklingTextModel
from .modeling_qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextModel

__all__ = ["InklingForCausalLM", "InklingTextModel", "Qwen4ExpForCausalLM", "Qwen4ExpTextModel"]
