"""Requests to prompts: chat messages through the checkpoint's chat template, text through its tokenizer, and
a multimodal chat's images and audio through its media processors into the media inputs of our classes.

Media come inside the request only (``data:`` URLs, base64): the server opens no file and fetches nothing.
Each image or audio part becomes one placeholder in the rendered chat, which is widened to one token per
feature (Qwen4Exp: a token per merged patch group; Inkling: a token per image patch, a token per audio frame).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import wave

import numpy as np
import torch


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with the message the client gets."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


MAX_IMAGE_PIXELS = 64 * 1024 * 1024
MAX_AUDIO_SECONDS = 30 * 60


def _data_url(url: str, kind: str, param: str) -> tuple[str, bytes]:
    if not isinstance(url, str) or not url.startswith("data:"):
        raise BadRequest(f"an {kind} must come inside the request as a data: URL (base64); this server fetches no "
                         f"URL and opens no file", param)
    head, _, data = url.partition(",")
    if ";base64" not in head:
        raise BadRequest(f"an {kind} data: URL must be base64-encoded", param)
    try:
        return head[5:].split(";")[0], base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise BadRequest(f"the {kind} is not valid base64: {error}", param) from None


def decode_image(url: str, param: str):
    from PIL import Image

    _, raw = _data_url(url, "image", param)
    try:
        image = Image.open(io.BytesIO(raw))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise BadRequest(f"the image has {image.width}x{image.height} pixels, more than {MAX_IMAGE_PIXELS}",
                             param)
        return image.convert("RGB")
    except BadRequest:
        raise
    except Exception as error:  # PIL's errors: not an image, truncated, unsupported format
        raise BadRequest(f"the image cannot be read: {error}", param) from None


def decode_wav(raw: bytes, rate: int, param: str) -> np.ndarray:
    """16-bit (or 8/32-bit) PCM WAV bytes to mono float32 samples at ``rate`` Hz."""
    try:
        with wave.open(io.BytesIO(raw)) as w:
            channels, width, source_rate, frames = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            if frames > MAX_AUDIO_SECONDS * source_rate:
                raise BadRequest(f"the audio is longer than {MAX_AUDIO_SECONDS} s", param)
            data = w.readframes(frames)
    except BadRequest:
        raise
    except (wave.Error, EOFError) as error:
        raise BadRequest(f"the audio is not a PCM WAV file: {error}", param) from None
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}.get(width)
    if dtype is None:
        raise BadRequest(f"WAV samples of {width} bytes are not supported (1, 2 or 4)", param)
    samples = np.frombuffer(data, dtype=dtype).astype(np.float32)
    samples = (samples - 128.0) / 128.0 if width == 1 else samples / float(2 ** (8 * width - 1))
    samples = samples.reshape(-1, channels).mean(axis=1)
    if source_rate != rate and len(samples):
        n = max(1, round(len(samples) * rate / source_rate))
        samples = np.interp(np.arange(n) * (source_rate / rate), np.arange(len(samples)), samples).astype(np.float32)
    if not len(samples):
        raise BadRequest("the audio holds no samples", param)
    return samples


class Prompt:
    def __init__(self, ids: list[int], media: dict | None = None):
        self.ids, self.media = ids, media


class PromptBuilder:
    """The checkpoint's tokenizer and chat template, and for a multimodal checkpoint its media processors. It
    needs the model's config and class attribute ``media_inputs`` (empty: text only), never its weights: the
    server process of `hf-qsa-serve` does not load the model."""

    def __init__(self, path: str, config, tokenizer, chat_template_kwargs: dict | None = None, media_inputs=()):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.family = family_of(config)
        self.media_inputs = set(media_inputs)
        self.image_processor = self.feature_extractor = None
        self.image_token_id = self.audio_token_id = None
        self.media_problems: dict[str, str] = {}
        if not self.media_inputs:
            return
        self.image_token_id = getattr(config, "image_token_id", None)
        self.audio_token_id = getattr(config, "audio_token_id", None) if self.family == "inkling" else None
        try:
            from transformers import AutoImageProcessor

            self.image_processor = AutoImageProcessor.from_pretrained(path)
        except Exception as error:  # no preprocessor config, or a backend this machine lacks
            self.media_problems["image"] = f"{type(error).__name__}: {error}"
        if self.audio_token_id is not None:
            try:
                from transformers import AutoFeatureExtractor

                self.feature_extractor = AutoFeatureExtractor.from_pretrained(path)
            except Exception as error:
                self.media_problems["audio"] = f"{type(error).__name__}: {error}"
            self.dmel = _dmel_settings(path, config)

    @property
    def takes_images(self) -> bool:
        return self.image_processor is not None

    @property
    def takes_audio(self) -> bool:
        return self.feature_extractor is not None

    # ------------------------------------------------------------------ text
    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat(self, messages: list[dict], template_kwargs: dict | None = None) -> Prompt:
        """Messages (OpenAI's shape, checked by the schema) to prompt ids and media."""
        images, clips, rendered = [], [], []
        for i, message in enumerate(messages):
            content = message.get("content")
            if content is None or isinstance(content, str):
                rendered.append({"role": message["role"], "content": content or ""})
                continue
            parts = []
            for j, part in enumerate(content):
                param = f"messages[{i}].content[{j}]"
                kind = part["type"]
                if kind in ("text", "input_text", "output_text", "refusal"):
                    parts.append({"type": "text", "text": part.get("text") or part.get("refusal") or ""})
                elif kind == "image_url":
                    if not self.takes_images:
                        raise BadRequest(self._refusal("image"), param)
                    url = part["image_url"]
                    images.append(decode_image(url["url"] if isinstance(url, dict) else url, param))
                    parts.append({"type": "image"})
                elif kind == "input_audio":
                    if not self.takes_audio:
                        raise BadRequest(self._refusal("audio"), param)
                    audio = part["input_audio"]
                    if audio.get("format", "wav") != "wav":
                        raise BadRequest(f"audio format {audio.get('format')!r} is not supported: send wav", param)
                    _, raw = (None, _b64(audio.get("data"), param))
                    clips.append(decode_wav(raw, self.feature_extractor.sampling_rate, param))
                    parts.append({"type": "audio"})
                else:
                    raise BadRequest(f"content parts of type {kind!r} are not supported", param)
            if all(p["type"] == "text" for p in parts):
                rendered.append({"role": message["role"], "content": "".join(p["text"] for p in parts)})
            else:
                rendered.append({"role": message["role"], "content": parts})
        kwargs = {**self.chat_template_kwargs, **(template_kwargs or {})}
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise BadRequest("this checkpoint has no chat template: use /v1/completions", "messages")
        try:
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as error:  # the template's own checks (roles, order) raise here
            raise BadRequest(f"the chat template refused the messages: {error}", "messages") from None
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not images and not clips:
            return Prompt(ids)
        return self._with_media(ids, images, clips)

    def _refusal(self, kind: str) -> str:
        if not self.media_inputs:
            return f"this model takes text only, not {kind}: serve a multimodal checkpoint for {kind}"
        problem = self.media_problems.get(kind)
        return f"this server cannot read {kind}" + (f" ({problem})" if problem else " (the checkpoint has no processor for it)")

    # ------------------------------------------------------------------ media
    def _with_media(self, ids: list[int], images: list, clips: list) -> Prompt:
        media: dict = {}
        counts: dict[int, list[int]] = {}
        if images:
            out = self.image_processor(images=images, return_tensors="pt")
            media["pixel_values"] = out["pixel_values"]
            if self.family == "qwen4_exp":
                grid = out["image_grid_thw"]
                media["image_grid_thw"] = grid
                merge = getattr(self.image_processor, "merge_size", 1) or 1
                counts[self.image_token_id] = [int(g.prod()) // (merge * merge) for g in grid]
            else:
                counts[self.image_token_id] = [int(n) for n in out["num_patches"]]
        if clips:
            out = self.feature_extractor(clips, sampling_rate=self.feature_extractor.sampling_rate, return_tensors="pt")
            features = out["input_features"]
            mask = out.get("input_features_mask")
            if mask is None:
                mask = torch.ones(features.shape[:2], dtype=torch.long)
            low, high, bins = self.dmel
            centers = torch.linspace(low, high, bins, dtype=torch.float64).float()
            clamped = features.clamp(low, high)
            media["audio_input_ids"] = (clamped[..., None] - centers).abs().argmin(-1).to(torch.int32)
            media["audio_input_ids_mask"] = mask
            counts[self.audio_token_id] = [int(m.sum()) for m in mask]
        expanded: list[int] = []
        seen = {token: 0 for token in counts}
        for token in ids:
            if token in counts:
                k = seen[token]
                seen[token] += 1
                if k < len(counts[token]):
                    expanded += [token] * counts[token][k]
                continue
            expanded.append(token)
        for token, sizes in counts.items():
            if seen[token] != len(sizes):
                raise BadRequest(f"the chat template placed {seen[token]} placeholders "
                                 f"({self.tokenizer.convert_ids_to_tokens(token)!r}) for {len(sizes)} media parts",
                                 "messages")
        if self.family == "qwen4_exp":
            ids_tensor = torch.tensor(expanded)
            media["mm_token_type_ids"] = (ids_tensor == self.image_token_id).long()[None]
        return Prompt(expanded, media)


def _b64(data, param: str) -> bytes:
    if not isinstance(data, str):
        raise BadRequest("input_audio.data must be a base64 string", param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise BadRequest(f"the audio is not valid base64: {error}", param) from None


def _dmel_settings(path: str, config) -> tuple[float, float, int]:
    """(low, high, bins) of Inkling's audio quantization: the processor config's, else its defaults; the bins
    follow the audio config's vocabulary."""
    settings = {}
    file = os.path.join(str(path), "processor_config.json")
    if os.path.isfile(file):
        with open(file) as f:
            settings = json.load(f)
    audio_config = getattr(config, "audio_config", None)
    bins = settings.get("num_dmel_bins") or getattr(audio_config, "mel_vocab_size", None) or 16
    return float(settings.get("dmel_min_value", -7.0)), float(settings.get("dmel_max_value", 2.0)), int(bins)


def family_of(config) -> str:
    model_type = getattr(config, "model_type", "")
    if model_type.startswith("qwen4_exp"):
        return "qwen4_exp"
    if model_type.startswith("inkling"):
        return "inkling"
    raise ValueError(f"model_type {model_type!r} is neither Qwen4Exp nor Inkling")
