"""Multi-token prediction drafts (``generate(..., use_mtp=True)``) for `modeling.InklingForCausalLM` and
`modeling.InklingForConditionalGeneration`.

transformers drafts with `MtpModel`: ``num_mtp_layers`` extra decoder layers whose weights sit in the
checkpoint under ``model.mtp.*``, in text and multimodal checkpoints alike (our classes ignore them when they
load; `MtpModel.from_pretrained` reads them from ``config.name_or_path``), built from the text config
(``get_mtp_config``). Each round they take the main model's last hidden states
(``output_hidden_states=-1``, the final-normed state) and draft one token per MTP layer; the main model
verifies them in one forward and crops what it rejected.

`MtpModel` builds its layers from the class of the main model's last decoder layer. Ours runs on the
paged cache, while the MTP layers keep their own small transformers cache (`MtpCache`), so here they are
built from transformers' own `InklingDecoderLayer` (same parameter names). Only the main model's state
lives in the `QSAPagedCache`, which `generate()` builds with ``num_speculative_tokens = num_mtp_layers``.
"""

from __future__ import annotations

import re

from torch import nn
from transformers.cache_utils import MtpCache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.generation.candidate_generator import MTPCandidateGenerator
from transformers.modeling_layers import MtpLayer, MtpModel
from transformers.modeling_utils import PreTrainedModel
from transformers.models.inkling.modeling_inkling import InklingDecoderLayer, InklingRMSNorm

# Checkpoint keys of the MTP layers (upstream's Inkling classes ignore `model.mtp.*` when they load).
MTP_WEIGHTS = re.compile(r"^(model\.)?mtp\.")


class InklingMtpModel(MtpModel):
    """transformers' `MtpModel` whose layers are transformers' `InklingDecoderLayer` blocks."""

    def __init__(self, main_model, num_mtp_layers: int):
        PreTrainedModel.__init__(self, main_model.language_model.config.get_mtp_config())
        self.loss_type = "ForCausalLM"
        self.num_mtp_layers = num_mtp_layers
        # Inkling configs carry `chain_hidden_post_norm`: no per-layer post norm, at most one shared by the chain.
        self.use_post_norm = False
        self.use_shared_post_norm = bool(getattr(self.config, "chain_hidden_post_norm", False))
        self.layers = nn.ModuleList(
            [MtpLayer(self.config, InklingDecoderLayer, InklingRMSNorm, k, False) for k in range(num_mtp_layers)]
        )
        if self.use_shared_post_norm:
            self.shared_post_norm = InklingRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
        self.tie_with_main_model(main_model)  # embeddings and head are the main model's; Inkling has no rotary
        self.has_per_layer_rope = False
        self.post_init()

    @staticmethod
    def get_mtp_weights_regex(main_model) -> re.Pattern:
        # transformers reads as MTP weights every checkpoint key matching a pattern the main model ignores on load;
        # ours ignore more than MTP layers (a multimodal checkpoint's tower keys for the text class, say), and
        # Inkling checkpoints, multimodal ones included, keep the MTP layers under `model.mtp.`.
        return MTP_WEIGHTS

    def get_weight_conversions(self, main_model):
        # transformers finds the checkpoint layout of MTP weights by class name ("MtpModel") and skips classes
        # defined outside the library unless their name is registered: register ours with the mapping in effect.
        # The conversions then come in transformers' order: MTP layers numbered after the main model's
        # (``layers.{num_hidden_layers + k}.``) renamed to ``layers.{k}.mtp_block.`` first, then the MTP layout
        # (which moves ``eh_proj``/``enorm``/``hnorm`` back out of ``mtp_block``), then the main model's.
        mapping = get_checkpoint_conversion_mapping("MtpModel")
        if mapping is not None:
            register_checkpoint_conversion_mapping(type(self).__name__, mapping, overwrite=True)
        return super().get_weight_conversions(main_model)


class InklingMTPCandidateGenerator(MTPCandidateGenerator):
    """`MTPCandidateGenerator` drafting with `InklingMtpModel`; drafting itself is transformers' own."""

    def __init__(self, main_model, generation_config, model_kwargs, logits_processor=None):
        # The text model's config: the main model may be the multimodal class (a composite config).
        text_config = main_model.language_model.config
        self.num_mtp_layers = getattr(text_config, "num_mtp_layers", None)
        if self.num_mtp_layers is None:
            raise ValueError("use_mtp=True needs a config with `num_mtp_layers` (a checkpoint with MTP weights)")
        self.model_kwargs_overrides = {"output_hidden_states": -1}  # the main model's last hidden states
        self.device = next(main_model.language_model.layers[-1].parameters()).device
        self.mtp_model = InklingMtpModel.from_pretrained(main_model, device_map={"": self.device})
        self.mtp_cache = MtpCache(config=text_config.get_mtp_config())
        self.mtp_cache.activate_past_recording()
        self.do_sample = generation_config.do_sample
        self.logits_processor = logits_processor
        self.is_main_model_prefill = True
