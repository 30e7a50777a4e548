"""The served checkpoint on our classes: the family from the config's model type, text or multimodal from its
sub-configs (transformers' server resolves `getattr(transformers, architectures[0])`, its own classes)."""

from __future__ import annotations

import logging
import os

import torch

from .prompts import family_of

logger = logging.getLogger(__name__)


def model_class(config):
    import modeling

    family = family_of(config)
    multimodal = any(getattr(config, name, None) is not None for name in ("vision_config", "audio_config"))
    return {
        ("qwen4_exp", False): modeling.Qwen4ExpForCausalLM,
        ("qwen4_exp", True): modeling.Qwen4ExpForConditionalGeneration,
        ("inkling", False): modeling.InklingForCausalLM,
        ("inkling", True): modeling.InklingForConditionalGeneration,
    }[family, multimodal]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def torch_dtype(dtype: str):
    """``--dtype`` as from_pretrained takes it: "auto", or a torch dtype by name (a `ValueError` otherwise)."""
    if dtype == "auto":
        return "auto"
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"--dtype must be 'auto' or a torch dtype such as bfloat16, got {dtype!r}")
    return value


def load_model(path: str, device: str = "auto", dtype: str = "auto"):
    """The checkpoint at ``path`` (a folder, or a hub id already in the local cache) on our class, on ``device``,
    in eval mode."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    cls = model_class(config)
    logger.info("loading %s as %s", path, cls.__name__)
    return cls.from_pretrained(path, dtype=torch_dtype(dtype)).to(resolve_device(device)).eval()


def load(path: str, device: str = "auto", dtype: str = "auto"):
    """(model, tokenizer) of the checkpoint at ``path``."""
    from transformers import AutoTokenizer

    return load_model(path, device, dtype), AutoTokenizer.from_pretrained(path)


def load_generation_config(path: str, config):
    """The checkpoint's generation config without its model: its generation_config.json, else the one
    transformers derives from the model's config (as from_pretrained does when the file is missing)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        return GenerationConfig.from_model_config(config)


def default_model_name(path: str) -> str:
    """A local folder is named by its last component; anything else as given."""
    stripped = str(path).rstrip("/\\")
    return os.path.basename(stripped) if os.path.isdir(stripped) else stripped
