"""Tiny checkpoints with a tokenizer and chat template, and a real `hf-qsa-serve` process on a free port.

Checkpoints (written by transformers' own classes, random weights as the model tests use):

* ``qwen4_exp``: a text Qwen4ExpForCausalLM (`helpers.qwen4.tiny_config`);
* ``inkling_audio``: an InklingForConditionalGeneration with an audio processor (the feature extractor) and no
  image processor (transformers' Inkling image processor needs torchvision);
* ``qwen4_exp_image``: a Qwen4ExpForConditionalGeneration with its image processor (PIL backend).

The tokenizer is `hf_qsa_cache.server.toy.toy_tokenizer`: one id per character, ChatML template, eos
``<|im_end|>`` (id 1).
"""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import time
import urllib.request
import wave

import numpy as np
import torch
import transformers

from hf_qsa_cache.server.toy import chat_template, save_toy_checkpoint, toy_tokenizer

from .qwen4 import randomize_, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOS = 1
# Qwen4Exp multimodal: the vision ids (as tests/models/test_multimodal_qwen4_exp.py lays them out).
Q_IMAGE, Q_VIDEO, Q_START, Q_END = 90, 91, 92, 93
# Inkling multimodal: 96 ids, the last 6 past the unpadded vocabulary (never generated).
I_VOCAB, I_UNPADDED, I_IMAGE_BOS, I_AUDIO_BOS, I_IMAGE, I_AUDIO = 96, 90, 92, 93, 94, 95
MEL_BINS = 8


def qwen4_exp_text(path) -> str:
    torch.manual_seed(0)
    model = transformers.Qwen4ExpForCausalLM(tiny_config(eos_token_id=EOS)).eval()
    randomize_(model, 0)
    return save_toy_checkpoint(path, model, toy_tokenizer(96))


def qwen4_exp_image(path) -> str:
    from transformers import Qwen4ExpConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig

    vision = Qwen4ExpVisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
                                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                                  num_position_embeddings=16, in_channels=3)
    config = Qwen4ExpConfig(text_config=tiny_config(eos_token_id=EOS).to_dict(), vision_config=vision.to_dict(),
                            image_token_id=Q_IMAGE, video_token_id=Q_VIDEO, vision_start_token_id=Q_START,
                            vision_end_token_id=Q_END)
    torch.manual_seed(0)
    model = transformers.Qwen4ExpForConditionalGeneration(config).eval()
    randomize_(model, 1)
    specials = {"<|image_pad|>": Q_IMAGE, "<|video_pad|>": Q_VIDEO, "<|vision_start|>": Q_START,
                "<|vision_end|>": Q_END}
    tokenizer = toy_tokenizer(96, specials, chat_template(image="<|vision_start|><|image_pad|><|vision_end|>"))
    images = Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16,
                                      max_pixels=256)
    return save_toy_checkpoint(path, model, tokenizer, image_processor=images)


def inkling_audio(path) -> str:
    from transformers import InklingConfig
    from transformers.models.inkling.feature_extraction_inkling import InklingFeatureExtractor

    text = dict(
        vocab_size=I_VOCAB, unpadded_vocab_size=I_UNPADDED, hidden_size=64, num_hidden_layers=5,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        sliding_window_size=6, d_rel=4, rel_extent=12, log_scaling_n_floor=4, log_scaling_alpha=0.5,
        conv_kernel_size=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, dense_mlp_idx=2, logits_mup_width_multiplier=1.5,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=EOS,
    )
    config = InklingConfig(text_config=text, vision_config=dict(patch_size=2, temporal_patch_size=2,
                                                                num_hidden_layers=3),
                           audio_config=dict(n_mel_bins=MEL_BINS, mel_vocab_size=16), image_token_id=I_IMAGE,
                           audio_token_id=I_AUDIO, image_bos_token_id=I_IMAGE_BOS, audio_bos_token_id=I_AUDIO_BOS)
    torch.manual_seed(0)
    model = transformers.InklingForConditionalGeneration(config).eval()
    randomize_(model, 2)
    specials = {"<|image_bos|>": I_IMAGE_BOS, "<|audio_bos|>": I_AUDIO_BOS, "<|image|>": I_IMAGE,
                "<|audio|>": I_AUDIO}
    tokenizer = toy_tokenizer(I_VOCAB, specials, chat_template(image="<|image_bos|><|image|>",
                                                               audio="<|audio_bos|><|audio|>"))
    return save_toy_checkpoint(path, model, tokenizer, feature_extractor=InklingFeatureExtractor(feature_size=MEL_BINS))


# ----------------------------------------------------------------------------- media as a client sends them
def png_data_url(height: int, width: int, seed: int) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def wav_base64(samples: int, seed: int, rate: int = 16000) -> str:
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / rate
    wave_ = sum(rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 6000) * t) for _ in range(3))
    pcm = (np.clip(wave_, -1, 1) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return base64.b64encode(buffer.getvalue()).decode()


# ----------------------------------------------------------------------------- the server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m hf_qsa_cache.serve PATH`` on a free port, one torch thread; `wait` until /health is 200."""

    def __init__(self, path: str, *args: str, env: dict | None = None, log=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        command = [sys.executable, "-m", "hf_qsa_cache.serve", str(path), "--port", str(self.port),
                   "--torch-threads", "1", "--log-level", "warning", *args]
        self.log = open(log, "w") if log else subprocess.DEVNULL
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

    def wait(self, timeout: float = 120) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}: {self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not come up in {timeout} s: {self.output()}")

    def output(self) -> str:
        if not self.log_path:
            return ""
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def stop(self, timeout: float = 20) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()
        return self.process.returncode
