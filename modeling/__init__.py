"""Drop-in Qwen4Exp and Inkling modeling on `QSAPagedCache`."""

from .modeling_inkling import InklingForCausalLM, InklingTextModel
from .modeling_qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextModel
from .multimodal_inkling import InklingForConditionalGeneration, InklingModel
from .multimodal_qwen4_exp import Qwen4ExpForConditionalGeneration, Qwen4ExpModel

__all__ = [
    "InklingForCausalLM", "InklingForConditionalGeneration", "InklingModel", "InklingTextModel", "Qwen4ExpForCausalLM",
    "Qwen4ExpForConditionalGeneration", "Qwen4ExpModel", "Qwen4ExpTextModel",
]
