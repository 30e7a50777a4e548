"""Qwen4Exp with images and video on `QSAPagedCache`: drop-in for transformers'
`Qwen4ExpForConditionalGeneration` (same config, parameter names and checkpoints).

The vision tower, the feature merge at placeholder tokens and the 3-D RoPE index (`get_rope_index`) are
transformers' own; the language model is ours (`Qwen4ExpTextModel`), so every cached state is paged.

Positions. A prompt with media is rotated at the 3-D (T, H, W) positions `get_rope_index` gives; after it a
row continues at ``its length + its delta`` on all three axes, where the delta (negative for an image: its
tokens span fewer positions than tokens) is kept per row by the cache (`QSAPagedCache.rope_deltas`), not on
the model as upstream keeps it: rows of one batch, rows of continuous batching and several caches never share
it. The QSA indexer rotates each compressed group key at the 3-D position of the group's first token, which
the raw-key ring keeps with each key (nothing else of the position history is kept).

Media go only into the forward that holds their placeholder tokens (generate() passes them to its first
forward only, as upstream does); a prompt longer than the prefill chunk is embedded once, then prefilled in
chunks that may cut through an image.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModel
from transformers.models.qwen4_exp import modeling_qwen4_exp as upstream
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpConfig

from transformers.utils import can_return_tuple

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.generation import lands_whole
from hf_qsa_cache.serving.runner import splice_prompt_embeddings
from hf_qsa_cache.speculative import drafts_without_placeholders

from .checkpoints import use_upstream_conversions
from .modeling_qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpPreTrainedModel, Qwen4ExpTextModel, step_position_ids

def fill_pads_from_left(positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``positions [..., B, T]`` where each pad after a real token takes that token's position (generation
    continues from a row's real length; pads are never read). Pads before the first real token keep theirs."""
    if mask is None:
        return positions
    T = mask.shape[-1]
    columns = torch.arange(T, device=mask.device).expand_as(mask)
    latest_real = torch.where(mask.bool(), columns, -1).cummax(dim=-1).values
    source = torch.where(latest_real >= 0, latest_real, columns)
    return positions.gather(-1, source.expand_as(positions).to(positions.device))


class Qwen4ExpModel(Qwen4ExpPreTrainedModel):
    """transformers' vision tower and our text model (parameter names as upstream: ``visual.*``,
    ``language_model.*``)."""

    config_class = Qwen4ExpConfig
    input_modalities = ("image", "video", "text")
    _no_split_modules = ["Qwen4ExpTextDecoderLayer", "Qwen4ExpVisionBlock"]

    def __init__(self, config: Qwen4ExpConfig):
        super().__init__(config)
        self.visual = AutoModel.from_config(config.vision_config)
        self.language_model = Qwen4ExpTextModel(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.embed_tokens

    def set_input_embeddings(self, value):
        self.language_model.embed_tokens = value

    # transformers' own media code: the vision tower's features, their placeholders, the 3-D RoPE index.
    get_image_features = upstream.Qwen4ExpModel.get_image_features
    get_video_features = upstream.Qwen4ExpModel.get_video_features
    get_placeholder_mask = upstream.Qwen4ExpModel.get_placeholder_mask
    get_vision_position_ids = upstream.Qwen4ExpModel.get_vision_position_ids
    get_rope_index = upstream.Qwen4ExpModel.get_rope_index

    def embed(self, input_ids, inputs_embeds, pixel_values=None, pixel_values_videos=None, image_grid_thw=None,
              video_grid_thw=None, mm_encoder_outputs=None, **kwargs) -> torch.Tensor:
        """Token embeddings with each image's and video's features at its placeholder tokens."""
        if (pixel_values is not None or pixel_values_videos is not None) and mm_encoder_outputs is not None:
            raise ValueError("pass pixel_values / pixel_values_videos or mm_encoder_outputs, not both")
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        encoded = dict(mm_encoder_outputs or {})
        if encoded.get("image") is None and pixel_values is not None:
            encoded["image"] = self.get_image_features(pixel_values, image_grid_thw, return_dict=True, **kwargs)
        if encoded.get("video") is None and pixel_values_videos is not None:
            encoded["video"] = self.get_video_features(pixel_values_videos, video_grid_thw, return_dict=True,
                                                       **kwargs)
        for kind in ("image", "video"):
            if encoded.get(kind) is None:
                continue
            features = torch.cat(encoded[kind].pooler_output, dim=0).to(inputs_embeds.device, inputs_embeds.dtype)
            masks = self.get_placeholder_mask(input_ids, inputs_embeds=inputs_embeds, **{f"{kind}_features": features})
            inputs_embeds = inputs_embeds.masked_scatter(masks[0 if kind == "image" else 1], features)
        return inputs_embeds

    def media_positions(self, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask,
                        start: list[int]) -> tuple[torch.Tensor, list[int | None]]:
        """3-D positions ``[3, B, L]`` of a step whose rows continue at RoPE positions ``start`` (0 for a new
        row), and the position each row continues at after it (None for a row with no real token in it).

        ``attention_mask``: this step's ``[B, L]`` columns (or None)."""
        if mm_token_type_ids is None:
            raise ValueError("images or video were passed without mm_token_type_ids (the processor returns them "
                             "with input_ids): the 3-D positions of their tokens cannot be computed")
        if input_ids is None:
            raise ValueError("images or video need input_ids (their placeholder tokens give the 3-D positions)")
        B, L = input_ids.shape
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        real = mask.bool()
        counts = real.sum(dim=1).tolist()
        rows = [b for b in range(B) if counts[b] > 0]
        positions = torch.zeros(3, B, L, dtype=torch.long, device=input_ids.device)
        after: list[int | None] = [None] * B
        if rows:  # media belong to rows in batch order, and a row with no real token holds none
            sel = torch.tensor(rows, device=input_ids.device)
            local, local_deltas = self.get_rope_index(
                input_ids[sel], mm_token_type_ids[sel].to(input_ids.device), image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw, attention_mask=mask[sel])
            offset = torch.tensor([start[b] for b in rows], device=input_ids.device).view(1, -1, 1)
            positions[:, sel] = torch.where(real[sel], local + offset, 0)
            for i, b in enumerate(rows):  # upstream's delta: highest local position + 1 - the row's tokens
                after[b] = start[b] + counts[b] + int(local_deltas[i])
        return fill_pads_from_left(positions, mask), after


class Qwen4ExpForConditionalGeneration(Qwen4ExpForCausalLM):
    """Images, video and text in, text out, on `QSAPagedCache` (``generate(past_key_values=QSAPagedCache(...))``
    or a cache generate() builds). Everything the text class runs (chunked prefill, CUDA-graph decode, assisted
    decoding, continuous batching of text requests) runs here; media go into the forward holding their tokens."""

    config_class = Qwen4ExpConfig
    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {}
    _no_split_modules = ["Qwen4ExpTextDecoderLayer", "Qwen4ExpVisionBlock"]
    input_modalities = ("image", "video", "text")

    def __init__(self, config: Qwen4ExpConfig):
        Qwen4ExpPreTrainedModel.__init__(self, config)
        self.model = Qwen4ExpModel(config)
        self.vocab_size = config.text_config.vocab_size
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    @property
    def language_model(self) -> Qwen4ExpTextModel:
        return self.model.language_model

    def get_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
        return self.model.get_image_features(pixel_values, image_grid_thw, **kwargs)

    def get_video_features(self, pixel_values_videos, video_grid_thw=None, **kwargs):
        return self.model.get_video_features(pixel_values_videos, video_grid_thw, **kwargs)

    @can_return_tuple
    @lands_whole
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, pixel_values=None, pixel_values_videos=None, image_grid_thw=None,
                video_grid_thw=None, mm_token_type_ids=None, mm_encoder_outputs=None, **kwargs):
        if pixel_values is None and pixel_values_videos is None and not mm_encoder_outputs:
            # A text-only step (decode, or a prompt without media): the text class's forward, graphs included.
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                                   **kwargs)
        inputs_embeds = self.model.embed(input_ids, inputs_embeds, pixel_values, pixel_values_videos,
                                         image_grid_thw, video_grid_thw, mm_encoder_outputs)
        B, L = inputs_embeds.shape[:2]
        cache = past_key_values if isinstance(past_key_values, QSAPagedCache) else None
        step_mask = None if attention_mask is None or attention_mask.dim() != 2 else attention_mask[:, -L:]
        start = cache.next_positions(B) if cache is not None and cache.columns_seen else [0] * B
        if position_ids is None:
            position_ids, after = self.model.media_positions(input_ids, mm_token_type_ids, image_grid_thw,
                                                             video_grid_thw, step_mask, start)
        else:
            after = positions_after(position_ids, step_mask, B, L)
        # The cache keeps each row's delta: where it continues, less its length after this step.
        before = cache.lengths[:B] if cache is not None else [0] * B
        counts = [L] * B if step_mask is None else step_mask.sum(dim=1).tolist()
        deltas = [None if a is None else a - before[b] - counts[b] for b, a in enumerate(after)]
        ple_input_ids = kwargs.pop("ple_input_ids", None)
        if ple_input_ids is None and input_ids is not None:
            ple_input_ids = input_ids  # PLE hashes the placeholder ids, as upstream
        return super().forward(input_ids=None, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                               ple_input_ids=ple_input_ids, rope_deltas=deltas, **kwargs)

    # Continuous batching: a request's media (`add_request(ids, pixel_values=..., ...)`) are encoded once, and
    # steps holding its prompt tokens run from those embeddings and positions.
    media_inputs = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids",
                    "mm_encoder_outputs")

    @torch.no_grad()
    def encode_prompt(self, input_ids: torch.Tensor, media: dict) -> dict:
        """One prompt ``[1, n]`` with its media: its embeddings ``[n, hidden]``, 3-D positions ``[3, n]`` and the
        RoPE delta its row continues with."""
        grids = media.get("image_grid_thw"), media.get("video_grid_thw")
        embeds = self.model.embed(input_ids, None, media.get("pixel_values"), media.get("pixel_values_videos"),
                                  *grids, media.get("mm_encoder_outputs"))
        positions, after = self.model.media_positions(input_ids, media.get("mm_token_type_ids"), *grids, None, [0])
        return {"embeds": embeds[0], "positions": positions[:, 0], "delta": after[0] - input_ids.shape[1]}

    def prompt_step_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                           rows: list[tuple[dict | None, int]], cache: QSAPagedCache) -> dict:
        """Forward inputs of a step ``[B, L]`` (left-padded) whose row ``b`` holds ``rows[b][1]`` tokens and has
        the prompt encoding ``rows[b][0]`` (None: a text prompt): embeddings, 3-D positions, PLE ids, deltas."""
        B, L = input_ids.shape
        embeds = self.language_model.embed_tokens(input_ids)
        spans = splice_prompt_embeddings(embeds, attention_mask, rows)
        positions = torch.zeros(3, B, L, dtype=torch.long, device=input_ids.device)
        deltas: list[int | None] = [None] * B
        for b, ((encoded, _), (cols, logical)) in enumerate(zip(rows, spans)):
            delta = encoded["delta"] if encoded is not None else cache.rope_deltas[b]
            row = (logical + delta).expand(3, -1).clone()
            if encoded is not None:  # prompt tokens at their 3-D positions, the rest after them
                deltas[b] = delta
                prompt = logical < encoded["positions"].shape[1]
                row[:, prompt] = encoded["positions"][:, logical[prompt]]
            positions[:, b, cols] = row
        return {"inputs_embeds": embeds, "position_ids": positions, "ple_input_ids": input_ids,
                "rope_deltas": deltas}

    def _get_candidate_generator(self, generation_config, **kwargs):
        generator = super()._get_candidate_generator(generation_config=generation_config, **kwargs)
        drafts_without_placeholders(generator, (self.config.image_token_id, self.config.video_token_id))
        return generator

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        # generate() keeps [4, B, T] positions (a text row, then T/H/W) and extends each by one per step, so
        # every row continues from its own last position. Rows a passed cache holds continue at their delta;
        # the columns past what it holds get 3-D positions when they carry media.
        text = super()._prepare_position_ids_for_generation(inputs_tensor, model_kwargs)
        B, T = text.shape
        cache = model_kwargs.get("past_key_values")
        held = isinstance(cache, QSAPagedCache) and cache.columns_seen > 0
        past = cache.get_seq_length() if held else 0
        deltas = torch.tensor(cache.rope_deltas[:B] if held else [0] * B, device=text.device)
        positions = (text + deltas[:, None])[None].expand(3, B, T).clone()
        ids = model_kwargs.get("input_ids")
        ids = ids if ids is not None and ids.shape[1] > 0 else inputs_tensor
        mm = model_kwargs.get("mm_token_type_ids")
        grids = model_kwargs.get("image_grid_thw"), model_kwargs.get("video_grid_thw")
        is_ids = ids.dim() == 2 and not ids.is_floating_point()
        if is_ids and mm is not None and any(g is not None for g in grids) and bool(mm[:, past:].any()):
            mask = model_kwargs.get("attention_mask")
            new, _ = self.model.media_positions(ids[:, past:], mm[:, past:], *grids,
                                                None if mask is None else mask[:, past:],
                                                cache.next_positions(B) if held else [0] * B)
            positions[:, :, past:] = new.to(positions.device)
        return torch.cat([text[None], positions], dim=0)


def positions_after(position_ids: torch.Tensor, mask: torch.Tensor | None, B: int, L: int) -> list[int | None]:
    """The RoPE position each row continues at after a step rotated at the caller's ``position_ids`` (``[B,
    T]`` or ``[3 | 4, B, T]``): one past the highest position of its real tokens (None for a row with none)."""
    positions = step_position_ids(position_ids, B, L)
    real = torch.ones(B, L, dtype=torch.bool, device=positions.device) if mask is None else mask.bool().to(
        positions.device)
    highest = torch.where(real, positions, -1).amax(dim=(0, 2)).tolist()
    return [None if h < 0 else h + 1 for h in highest]


use_upstream_conversions(Qwen4ExpConfig.model_type)

__all__ = ["Qwen4ExpForConditionalGeneration", "Qwen4ExpModel"]
