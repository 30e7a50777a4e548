"""Inkling with images and audio on `QSAPagedCache`: drop-in for transformers' `InklingForConditionalGeneration`
(same config, parameter names and checkpoints).

The vision tower, the audio tower and the feature merge at placeholder tokens (``config.image_token_id``,
``config.audio_token_id``) are transformers' own; the language model is ours (`InklingTextModel`), so every
cached state is paged. Inkling has no RoPE: media change nothing but the embeddings at their placeholders.

Media go only into the forward that holds their placeholder tokens (generate() passes them to its first forward
only, as upstream does). That forward embeds the whole prompt once and runs the text class's forward from the
embeddings, so a prompt longer than the prefill chunk is prefilled in chunks that may cut through an image or
an audio clip; the placeholder ids are logged with the embeddings, so a later generate() continuing the cache is
still checked against what it holds. Every other step is the text class's own (CUDA-graph decode, speculative
decoding). Continuous batching takes each request's media with the request (``add_request(ids, pixel_values=...,
audio_input_ids=..., audio_input_ids_mask=...)``), encodes them once, and runs the steps holding its prompt
tokens from those embeddings.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.inkling import modeling_inkling as upstream
from transformers.models.inkling.configuration_inkling import InklingConfig

from hf_qsa_cache.generation import check_token_ids, lands_whole
from hf_qsa_cache.serving.runner import splice_prompt_embeddings
from hf_qsa_cache.speculative import drafts_without_placeholders

from .checkpoints import use_upstream_conversions
from .modeling_inkling import InklingForCausalLM, InklingPagedPreTrainedModel, InklingTextModel


class InklingModel(InklingPagedPreTrainedModel):
    """Our text model and transformers' audio and vision towers (parameter names as upstream:
    ``language_model.*``, ``audio_tower.*``, ``vision_tower.*``)."""

    config_class = InklingConfig
    config: InklingConfig
    input_modalities = ("image", "text", "audio")
    accepts_loss_kwargs = False

    def __init__(self, config: InklingConfig):
        super().__init__(config)
        self.vocab_size = config.text_config.vocab_size
        self.language_model = InklingTextModel(config.text_config)
        self.audio_tower = upstream.InklingAudioModel(config.audio_config)
        self.vision_tower = upstream.InklingVisionModel(config.vision_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.embed_tokens

    def set_input_embeddings(self, value):
        self.language_model.embed_tokens = value

    # transformers' own media code: each tower's features and the placeholder mask that checks their count.
    get_image_features = upstream.InklingModel.get_image_features
    get_audio_features = upstream.InklingModel.get_audio_features
    get_placeholder_mask = upstream.InklingModel.get_placeholder_mask

    def embed(self, input_ids=None, inputs_embeds=None, pixel_values=None, audio_input_ids=None,
              audio_input_ids_mask=None, mm_encoder_outputs=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token embeddings with each image's and audio clip's features at its placeholder tokens, as upstream's
        `InklingModel.forward` merges them; and the image features (upstream's ``image_hidden_states``).

        ``mm_encoder_outputs``: features encoded beforehand, by modality (``"image"``, ``"audio"``), used instead
        of running a tower."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        encoded = dict(mm_encoder_outputs or {})
        if pixel_values is not None and encoded.get("image") is not None:
            raise ValueError("You cannot specify both pixel_values and mm_encoder_outputs at the same time")
        if audio_input_ids is not None and encoded.get("audio") is not None:
            raise ValueError("pass audio_input_ids or mm_encoder_outputs['audio'], not both")
        if inputs_embeds is None:
            check_token_ids(input_ids, self.config.text_config.vocab_size)
            inputs_embeds = self.get_input_embeddings()(input_ids)
        if encoded.get("image") is None and pixel_values is not None:
            encoded["image"] = self.get_image_features(pixel_values, return_dict=True, **kwargs)
        if encoded.get("audio") is None and audio_input_ids is not None:
            encoded["audio"] = self.get_audio_features(audio_input_ids, audio_input_ids_mask)
        for kind, token_id in (("image", self.config.image_token_id), ("audio", self.config.audio_token_id)):
            if encoded.get(kind) is None:
                continue
            features = encoded[kind].pooler_output.to(inputs_embeds.device, inputs_embeds.dtype)
            mask = self.get_placeholder_mask(input_ids, inputs_embeds, features, token_id)
            inputs_embeds = inputs_embeds.masked_scatter(mask, features)
        image = encoded.get("image")
        return inputs_embeds, None if image is None else image.pooler_output


class InklingForConditionalGeneration(InklingForCausalLM):
    """Images, audio and text in, text out, on `QSAPagedCache` (``generate(past_key_values=QSAPagedCache(...))``
    or a cache generate() builds). Everything the text class runs (chunked prefill, CUDA-graph decode, prompt
    lookup, assistant models and MTP drafts, continuous batching) runs here; media go into the forward holding
    their placeholder tokens."""

    config_class = InklingConfig
    config: InklingConfig
    # `embed` and `unembed` are separate tensors in the checkpoints, never tied
    _tied_weights_keys = {}
    _tp_plan = {"lm_head": "rowwise_split_input"}
    _pp_plan = {}
    accepts_loss_kwargs = False
    input_modalities = ("image", "text", "audio")

    def __init__(self, config: InklingConfig):
        InklingPagedPreTrainedModel.__init__(self, config)
        self.model = InklingModel(config)
        self.vocab_size = config.text_config.vocab_size
        # checkpoints store `unembed` padded to vocab_size; logits are cut to unpadded_vocab_size (`_logits`)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    @property
    def language_model(self) -> InklingTextModel:
        return self.model.language_model

    def get_image_features(self, pixel_values: torch.Tensor, **kwargs):
        return self.model.get_image_features(pixel_values, **kwargs)

    @lands_whole
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        audio_input_ids: torch.LongTensor | None = None,
        audio_input_ids_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        mm_encoder_outputs: dict | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """upstream's arguments: ``pixel_values`` ``[patches, temporal_patch_size, patch_size, patch_size,
        channels]`` (one placeholder per patch), ``audio_input_ids`` ``[clips, frames, n_mel_bins]`` dMel bins
        with ``audio_input_ids_mask`` ``[clips, frames]`` (one placeholder per valid frame); media of all rows in
        row order."""
        text = dict(attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                    labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        if pixel_values is None and audio_input_ids is None and not mm_encoder_outputs:
            # A step without media (decode, drafts, a text prompt): the text class's forward, graphs included.
            return super().forward(input_ids=input_ids, inputs_embeds=inputs_embeds, return_dict=return_dict, **text)
        inputs_embeds, image_features = self.model.embed(input_ids, inputs_embeds, pixel_values, audio_input_ids,
                                                         audio_input_ids_mask, mm_encoder_outputs)
        if input_ids is not None:
            text.setdefault("token_ids", input_ids)  # the placeholder ids are logged for check_continues
        out = super().forward(input_ids=None, inputs_embeds=inputs_embeds, return_dict=True, **text)
        if image_features is not None:
            out["image_hidden_states"] = image_features
        return out if return_dict is not False else out.to_tuple()

    # Continuous batching: a request's media (`add_request(ids, pixel_values=..., audio_input_ids=..., ...)`) are
    # encoded once, and steps holding its prompt tokens run from those embeddings.
    media_inputs = ("pixel_values", "audio_input_ids", "audio_input_ids_mask", "mm_encoder_outputs")

    @torch.no_grad()
    def encode_prompt(self, input_ids: torch.Tensor, media: dict) -> dict:
        """One prompt ``[1, n]`` with its media: its embeddings ``[n, hidden]``."""
        embeds, _ = self.model.embed(input_ids, None, media.get("pixel_values"), media.get("audio_input_ids"),
                                     media.get("audio_input_ids_mask"), media.get("mm_encoder_outputs"))
        return {"embeds": embeds[0]}

    def prompt_step_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                           rows: list[tuple[dict | None, int]], cache) -> dict:
        """Forward inputs of a step ``[B, L]`` (left-padded) whose row ``b`` holds ``rows[b][1]`` tokens and has
        the prompt encoding ``rows[b][0]`` (None: a text prompt): embeddings, and the ids they stand for."""
        embeds = self.language_model.embed_tokens(input_ids)
        splice_prompt_embeddings(embeds, attention_mask, rows)
        return {"inputs_embeds": embeds, "token_ids": input_ids}

    def _get_candidate_generator(self, generation_config, **kwargs):
        generator = super()._get_candidate_generator(generation_config=generation_config, **kwargs)
        drafts_without_placeholders(generator, (self.config.image_token_id, self.config.audio_token_id))
        return generator

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, inputs_embeds=None, pixel_values=None,
                                      audio_input_ids=None, audio_input_ids_mask=None, use_cache=True,
                                      is_first_iteration=False, **kwargs):
        # As upstream: media only in the first forward of a generate() call (or every forward without a cache).
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            is_first_iteration=is_first_iteration, **kwargs,
        )
        if is_first_iteration or not use_cache:
            model_inputs["pixel_values"] = pixel_values
            model_inputs["audio_input_ids"] = audio_input_ids
            model_inputs["audio_input_ids_mask"] = audio_input_ids_mask
        return model_inputs


# Checkpoints of the composite model type are converted as transformers converts them for its own class.
use_upstream_conversions(InklingConfig.model_type)

__all__ = ["InklingForConditionalGeneration", "InklingModel"]
