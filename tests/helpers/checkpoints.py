"""Checkpoint files on disk, as the loading tests read and rewrite them."""

from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def read_checkpoint(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``folder``, by name."""
    tensors = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def rewrite_checkpoint(folder, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the checkpoint's weights by ``tensors`` (one unsharded file)."""
    for path in glob.glob(os.path.join(folder, "*.safetensors*")):
        os.remove(path)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
