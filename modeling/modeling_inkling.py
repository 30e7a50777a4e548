"""Inkling text model on `QSAPagedCache`: a drop-in for transformers' `InklingForCausalLM`.

Same config class (`InklingTextConfig`) and parameter names as transformers, so an upstream
state dict or checkpoint loads unchanged. Modules whose forward never touches the cache (MoE, MLP,
RMSNorm, embeddings, the relative-logits parameter) are imported from transformers; the short
convolutions and the attention are ours and read/write the paged stores by logical position:

* every forward runs inside ``cache.step`` (validation, block reservation, one metadata; a transaction);
* each short conv reads its taps from this forward's input or the paged conv store
  (`hf_qsa_cache.ops.sconv`), then stores its input;
* attention gathers the row's cached keys (all of them on full layers, the window on sliding
  layers), adds the current chunk, and gathers the relative bias per selected key
  (`hf_qsa_cache.ops.inkling_attention`).

Any 2-D padding mask works: a step whose pads follow real tokens is reordered so that each row's pads
come first (`hf_qsa_cache.padding`); pads are never written and never read.
"""


import torch
from torch import nn
from transformers.generation import GenerationMixin
from transformers.integrations.accelerate import force_accelerate_hooks
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.inkling import modeling_inkling as upstream
from transformers.models.inkling.configuration_inkling import InklingTextConfig
from transformers.models.inkling.modeling_inkling import (
    InklingCausalLMOutputWithPast,
    InklingMLP,
    InklingNormedEmbedding,
    InklingPreTrainedModel,
    InklingRelativeLogits,
    InklingRMSNorm,
)
from transformers.utils import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.attentions import StepWeights, keeps_caller_columns, returns_weights, step_columns
from hf_qsa_cache.cuda_graphs import decode_graphs_for
from hf_qsa_cache.generation import (
    PagedCacheGenerationMixin, check_token_ids, forward_cache, lands_whole,
)
from hf_qsa_cache.grouped import GroupPart, group_ids, group_parts, per_group
from hf_qsa_cache.metadata import StepMetadata
from hf_qsa_cache.padding import on_output_path, runs_any_padding
from hf_qsa_cache.serving import ContinuousBatchingMixin
from hf_qsa_cache.ops.conv_norm import conv_add_norm, normed_attention_inputs
from hf_qsa_cache.ops import records_grad
from hf_qsa_cache.ops.fp8 import dequantize_fp8
from hf_qsa_cache.ops.inkling_attention import _cached_slots, paged_rel_attention, paged_rel_attention_probs
from hf_qsa_cache.ops.linears import project, project_alone
from hf_qsa_cache.ops.experts import default_experts_implementation
from hf_qsa_cache.ops.moe import inkling_moe
from hf_qsa_cache.ops.rms_norm import defers_residual, normed_embedding
from hf_qsa_cache.ops.sconv import ConvTaps, short_conv
from hf_qsa_cache.step import RowGroup
from hf_qsa_cache.stores.inkling import STREAM_ATTN, STREAM_K, STREAM_MLP, STREAM_V

from .checkpoints import StrictLoadingMixin, use_upstream_conversions


class InklingMoE(upstream.InklingMoE):
    """transformers' MoE block (same modules and parameters); its router, projection included, runs as one
    launch where fused (`hf_qsa_cache.ops.inkling_router`), and its shared experts inside the selected or
    tiled experts' kernels where folded (`hf_qsa_cache.ops.experts.inkling_shared_experts_to_fold`), and its experts
    as the config's experts implementation says (`hf_qsa_cache.ops.moe`). Otherwise upstream's forward."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return inkling_moe(self, hidden_states, super().forward)


class InklingPagedShortConvolution(nn.Module):
    """Depthwise causal conv + residual whose history lives in the paged conv store."""

    def __init__(self, hidden_size: int, conv_kernel_size: int, layer_idx: int, conv_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.conv_idx = conv_idx
        self.conv_kernel_size = conv_kernel_size
        self.conv1d = nn.Conv1d(
            hidden_size, hidden_size, kernel_size=conv_kernel_size, groups=hidden_size,
            padding=conv_kernel_size - 1, bias=False,
        )

    @force_accelerate_hooks("conv1d")  # its weight is read directly; offloading hooks must load it first
    def forward(self, hidden_states: torch.Tensor, cache: QSAPagedCache, meta: StepMetadata) -> torch.Tensor:
        B, L, C = hidden_states.shape
        return short_conv(hidden_states.reshape(B * L, C), *self.taps(cache, meta, L)).view(B, L, C)

    def taps(self, cache: QSAPagedCache, meta: StepMetadata, query_len: int) -> ConvTaps:
        """What this conv reads and writes besides its input in a step of ``query_len`` columns."""
        store = cache.layers[self.layer_idx].conv
        table = store.table
        return ConvTaps(self.conv1d.weight.squeeze(1), store.stream(self.conv_idx), meta.block_tables[table],
                        cache.tables[table].block_size, meta.slots[table], meta.position, meta.prev_len, query_len)


def _prev_len_bound(meta: StepMetadata) -> list[int]:
    """Each row's length before this step, or (in a CUDA graph, where lengths change per replay) a bound."""
    return meta.host_prev_len if meta.host_prev_len is not None else [meta.max_seq_len]


class InklingPagedAttention(nn.Module):
    def __init__(self, config: InklingTextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_sliding = config.layer_types[layer_idx] == "hybrid_sliding"
        self.head_dim = config.swa_head_dim if self.is_sliding else config.head_dim
        self.num_heads = config.swa_num_attention_heads if self.is_sliding else config.num_attention_heads
        self.num_key_value_heads = config.swa_num_key_value_heads if self.is_sliding else config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.sliding_window = config.sliding_window_size if self.is_sliding else None
        self.rel_extent = config.sliding_window_size if self.is_sliding else config.rel_extent
        self.scaling = 1.0 / self.head_dim  # q and k are unit-RMS per head
        self.kv_table = "sliding" if self.is_sliding else "main"

        kv_width = self.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.r_proj = nn.Linear(config.hidden_size, self.num_heads * config.d_rel, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.k_sconv = InklingPagedShortConvolution(kv_width, config.conv_kernel_size, layer_idx, STREAM_K)
        self.v_sconv = InklingPagedShortConvolution(kv_width, config.conv_kernel_size, layer_idx, STREAM_V)
        self.q_norm = InklingRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = InklingRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rel_logits_proj = InklingRelativeLogits(config.d_rel, self.rel_extent)

    @force_accelerate_hooks("rel_logits_proj")  # its `proj` parameter is read directly
    def forward(self, hidden_states: torch.Tensor, cache: QSAPagedCache, meta: StepMetadata,
                attentions: StepWeights | None = None) -> torch.Tensor:
        """``attentions``: when given, this layer appends its attention probabilities ``[B, H, L, W]`` in the
        caller's columns (`paged_rel_attention_probs`, `hf_qsa_cache.attentions`); while autograd records, its
        output is computed from them."""
        B, L, _ = hidden_states.shape
        query, key, value, relative = project(hidden_states, self.q_proj, self.k_proj, self.v_proj, self.r_proj)
        # The query's norm, the key's and value's short convs and the key's norm in one launch where fused.
        query, key, value = normed_attention_inputs(query, key, value, self.q_norm, self.k_norm, self.k_sconv,
                                                    self.v_sconv, cache, meta, self.head_dim)
        relative = relative.view(B, L, self.num_heads, -1)

        log_scaling = None
        if not self.is_sliding and self.config.log_scaling_n_floor is not None:
            log_scaling = (float(self.config.log_scaling_n_floor), float(self.config.log_scaling_alpha))
        kv = cache.layers[self.layer_idx].kv
        keys, values = kv.flat()
        key_scales, value_scales = kv.flat_scales()  # an fp8 store's scales (None in the model's dtype)
        scales = {} if key_scales is None else {"key_scales": key_scales, "value_scales": value_scales}
        table, block_size = meta.block_tables[self.kv_table], cache.tables[self.kv_table].block_size
        weights = None
        if attentions is not None:  # before the op below writes this step's keys to the store
            weights = attentions.columns.to_caller(paged_rel_attention_probs(
                query, key, relative, self.rel_logits_proj.proj, keys, table, block_size, meta.position,
                meta.prev_len, _prev_len_bound(meta), meta.max_seq_len, scaling=self.scaling,
                window=self.sliding_window, log_scaling=log_scaling, key_scales=key_scales,
            ))
            attentions.append(weights)
        out = paged_rel_attention(
            query, key, value, relative, self.rel_logits_proj.proj, keys, values, table, block_size,
            meta.slots[self.kv_table], meta.position, meta.prev_len, _prev_len_bound(meta),
            scaling=self.scaling, window=self.sliding_window, log_scaling=log_scaling, **scales,
        )
        if weights is not None and records_grad(weights):
            # The output from the weights returned, as transformers' eager attention computes it, so that it
            # depends on them (the op above still wrote this step's keys and values to the store).
            values_at = self._values_by_position(value, values, table, block_size, meta, value_scales)
            out = attentions.columns.output(weights, attentions.columns.values_at(values_at),
                                            meta.position.view(B, L) >= 0).reshape(B, L, -1)
        return project_alone(out, self.o_proj)

    def _values_by_position(self, value: torch.Tensor, store: torch.Tensor, table: torch.Tensor, block_size: int,
                            meta: StepMetadata, scales: torch.Tensor | None = None):
        """A function of positions ``[B, W]`` giving the values ``[B, W, Hkv, D]`` this step may attend there: the
        store's (earlier forwards', within the window on a sliding layer) and this step's ``value`` ``[B, L, Hkv,
        D]`` (with its autograd history); zeros elsewhere."""
        B, L = value.shape[:2]
        cslot, cpos = _cached_slots(table, block_size, meta.prev_len, _prev_len_bound(meta), self.sliding_window)
        span = meta.max_seq_len + 1  # one extra position takes what is no position (-1), then is dropped
        by_position = value.new_zeros(B, span, *value.shape[2:])
        spare = lambda pos: torch.where(pos >= 0, pos, span - 1).long()  # noqa: E731
        by_position = by_position.index_put((torch.arange(B, device=value.device)[:, None], spare(cpos)),
                                            store[cslot].to(value.dtype) if scales is None
                                            else dequantize_fp8(store[cslot], scales[cslot], value.dtype))
        by_position = by_position.index_put((torch.arange(B, device=value.device)[:, None],
                                             spare(meta.position.view(B, L))), value)

        def at(position: torch.Tensor) -> torch.Tensor:
            return by_position[torch.arange(B, device=value.device)[:, None], position.clamp_max(span - 2)]

        return at


class InklingPagedDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: InklingTextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = InklingPagedAttention(config, layer_idx)
        self.mlp = InklingMoE(config) if config.mlp_layer_types[layer_idx] == "sparse" else InklingMLP(config)
        self.input_layernorm = InklingRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = InklingRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_sconv = InklingPagedShortConvolution(config.hidden_size, config.conv_kernel_size, layer_idx,
                                                       STREAM_ATTN)
        self.mlp_sconv = InklingPagedShortConvolution(config.hidden_size, config.conv_kernel_size, layer_idx,
                                                      STREAM_MLP)

    def forward(self, hidden_states: torch.Tensor, cache: QSAPagedCache, meta: StepMetadata,
                attentions: list | None = None, residual: torch.Tensor | None = None,
                pending_conv: InklingPagedShortConvolution | None = None, defer_residual: bool = False):
        """The layer on ``hidden_states``; with ``residual``, ``hidden_states`` is the previous layer's MLP output
        still to be added to it (upstream adds it at that layer's end), and with ``pending_conv`` still to pass
        that layer's MLP conv first. With ``defer_residual``, returns ``(MLP output before its conv, residual)``:
        this layer's conv and sum are left to the next norm in turn (`defers_residual`)."""
        with cache.replaying(meta):  # activation checkpointing may rerun this layer after the step
            return self._forward(hidden_states, cache, attentions, residual, pending_conv, defer_residual)

    def _forward(self, hidden_states: torch.Tensor, cache: QSAPagedCache, attentions: list | None,
                 residual: torch.Tensor | None, pending_conv: InklingPagedShortConvolution | None,
                 defer_residual: bool):
        meta = cache.step_metadata(hidden_states.device)
        cache.ensure_allocated(self.layer_idx, hidden_states.device, hidden_states.dtype)
        # The previous layer's MLP conv and residual add and this norm, in one pass where fused.
        residual, normed = conv_add_norm(pending_conv, hidden_states, residual, self.input_layernorm, cache, meta)
        attn = self.self_attn(normed, cache, meta, attentions)
        residual, normed = conv_add_norm(self.attn_sconv, attn, residual, self.post_attention_layernorm, cache, meta)
        out = self.mlp(normed)
        return (out, residual) if defer_residual else residual + self.mlp_sconv(out, cache, meta)

    def forward_grouped(self, hidden_states: torch.Tensor, parts: list[GroupPart], cache: QSAPagedCache,
                        residual: torch.Tensor | None, pending_conv: InklingPagedShortConvolution | None):
        """The layer on a grouped step's ``[1, T, H]`` (`hf_qsa_cache.grouped`): the convolutions and the attention
        one group at a time, the MLP over every token at once. Returns ``(MLP output before its conv, residual)``:
        its conv and sum are left to the next norm (as ``defer_residual``)."""
        cache.ensure_allocated(self.layer_idx, hidden_states.device, hidden_states.dtype)

        def mixer(part, h, r):
            meta = part.meta
            r, normed = conv_add_norm(pending_conv, h, r, self.input_layernorm, cache, meta)
            attn = self.self_attn(normed, cache, meta)
            return conv_add_norm(self.attn_sconv, attn, r, self.post_attention_layernorm, cache, meta)

        residual, normed = per_group(cache, parts, mixer, hidden_states, residual)
        return self.mlp(normed), residual


class InklingPagedPreTrainedModel(StrictLoadingMixin, InklingPreTrainedModel):
    config_class = InklingTextConfig
    config: InklingTextConfig
    _no_split_modules = ["InklingPagedDecoderLayer"]
    _can_record_outputs = {}
    # The experts are transformers' own `InklingExperts`, so their implementation can be chosen as upstream.
    _can_set_experts_implementation_cached_value = True
    # Attention never goes through the attention-function registry: the implementation is only read to say whether
    # output_attentions returns weights (eager) or an empty tuple (the rest), as transformers' classes return them.
    _can_set_attn_implementation_cached_value = True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """Ours (``"hf_qsa"``, `hf_qsa_cache.ops.experts.OURS`) unless the user names another, which transformers
        checks and which then runs as named."""
        return default_experts_implementation(requested_experts) or super().get_correct_experts_implementation(
            requested_experts)


# transformers 5.23's tensor-parallel plan for Inkling (`config.base_model_tp_plan`) fails three ways: the
# normed embedding cannot be cut on the vocabulary (the plan adds "embedding_rowwise"; its norm needs whole
# rows), the shared experts multiply raw 3-D parameters (a bmm of a tensor and a DTensor), and "colwise" on
# the packed gate/up tensor of the experts cuts it in the wrong place (wrong tokens, no error). Our text
# model replaces those entries: embedding and shared experts replicated, gate/up cut as a packed pair.
TP_PLAN_FIXES = {
    "embed_tokens": "replicate",
    "layers.*.mlp.shared_experts.gate_proj": "replicate",
    "layers.*.mlp.shared_experts.up_proj": "replicate",
    "layers.*.mlp.shared_experts.down_proj": "replicate",
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
}


# What a step with pads after real tokens reorders (`runs_any_padding`): inputs -> column dim; outputs ->
# (column dim, batch dim). Router logits are ``[B * L, experts]`` per MoE layer, viewed as ``[B, L, experts]``.
# (Attention weights come back in the caller's columns from the layers themselves: `hf_qsa_cache.attentions`.)
TOKEN_INPUTS = {"input_ids": -1, "inputs_embeds": 1, "token_ids": -1}
TOKEN_OUTPUTS = {"last_hidden_state": (1, 0), "hidden_states": (1, 0), "router_logits": (1, 0)}


class InklingTextModel(InklingPagedPreTrainedModel):
    # As upstream: output_router_logits records each router's routed logits (its first output). Hidden states and
    # attentions are collected by the layer loop itself.
    _can_record_outputs = {"router_logits": OutputRecorder(upstream.InklingTopkRouter, index=0)}

    def init_parallel_plans(self) -> None:
        super().init_parallel_plans()
        if self._tp_plan:
            self._tp_plan.pop("layers.*.mlp.shared_experts", None)  # replicated: no all-reduce of its output
            self._tp_plan.update(TP_PLAN_FIXES)

    def __init__(self, config: InklingTextConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = InklingNormedEmbedding(
            config.vocab_size, config.hidden_size, self.padding_idx, config.rms_norm_eps
        )
        self.layers = nn.ModuleList(
            [InklingPagedDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = InklingRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    @can_return_tuple  # outermost: the decorators below reorder the output's fields
    @lands_whole
    @keeps_caller_columns  # attention weights come back in the caller's columns from the layers themselves
    @runs_any_padding(per_token=TOKEN_INPUTS, outputs=TOKEN_OUTPUTS)
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,  # unused: Inkling has no RoPE
        past_key_values: QSAPagedCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        token_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        """``token_ids``: for a forward from ``inputs_embeds``, the ``[B, L]`` ids the embeddings stand for (the
        multimodal model passes its placeholder ids), logged for `QSAPagedCache.check_continues` as ``input_ids``
        would be. Without them such a step leaves the log incomplete and later calls go unchecked."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() != 2):
            raise ValueError("attention_mask must be a 2-D [batch, length] padding mask")
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        if output_attentions is None:
            output_attentions = getattr(self.config, "output_attentions", False)
        if inputs_embeds is None:
            check_token_ids(input_ids, self.config.vocab_size)
            inputs_embeds = self.embed(input_ids)
        B, L = inputs_embeds.shape[:2]

        # forward_cache tells an unasked use_cache (None) from an asked one; the config's default comes after.
        cache, use_cache = forward_cache(self, past_key_values, B, L, use_cache)
        if use_cache is None:
            use_cache = getattr(self.config, "use_cache", True)
        cache.check_model(self.config, inputs_embeds.dtype)

        all_hidden = [] if output_hidden_states else None
        weights = output_attentions and returns_weights(self.config)
        attentions = None
        logged = input_ids if input_ids is not None else token_ids
        with cache.step(B, L, attention_mask, inputs_embeds.device, logged) as meta:
            if weights:  # as upstream: every layer, [B, heads, L, the mask's columns]
                attentions = StepWeights(step_columns(attention_mask, B, L, meta.max_seq_len, inputs_embeds.device))
            hidden_states = self.run_layers(inputs_embeds, cache, meta, all_hidden, attentions)
        if output_hidden_states:  # as upstream: the last entry is the final-normed state (MTP drafts from it)
            all_hidden = tuple(all_hidden[:-1]) + (hidden_states,)
        if output_attentions:  # an empty tuple where transformers' attention returns no weights
            attentions = tuple(attentions or ())
        return MoeModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=cache if use_cache else None,
            hidden_states=all_hidden,
            attentions=attentions,
        )


    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``embed_tokens(input_ids)`` with its norm in one launch where fused (`rms_norm`); the module's own
        forward where it must run (a hook, an offloading wrapper)."""
        return normed_embedding(self.embed_tokens, self.embed_tokens.embed_norm, input_ids)

    def run_layers(self, inputs_embeds: torch.Tensor, cache: QSAPagedCache, meta: StepMetadata,
                   all_hidden: list | None = None, attentions: list | None = None) -> torch.Tensor:
        """Every layer and the final norm (device work only once the step's metadata is built, so a CUDA
        graph can record this). Appends each layer's input to ``all_hidden`` and its attention
        probabilities by key position to ``attentions`` when given."""
        hidden_states = inputs_embeds
        # The last layer's residual, and the conv of its MLP output, not yet applied (`defers_residual`).
        residual = pending_conv = None
        for layer in self.layers:
            if all_hidden is not None:
                all_hidden.append(hidden_states)
                hidden_states = on_output_path(hidden_states)  # retain_grad() on it works on reordered steps
            defer = all_hidden is None and defers_residual(layer, hidden_states)
            out = layer(hidden_states, cache, meta, attentions, residual=residual, pending_conv=pending_conv,
                        defer_residual=defer)
            hidden_states, residual = out if defer else (out, None)
            pending_conv = layer.mlp_sconv if defer else None
        if all_hidden is not None:
            all_hidden.append(hidden_states)
        return conv_add_norm(pending_conv, hidden_states, residual, self.norm, cache, meta)[1]

    def forward_grouped(self, input_ids: torch.Tensor, cache: QSAPagedCache, groups: list[RowGroup],
                        counts: list[int]) -> torch.Tensor:
        """The final-normed hidden state ``[1, T, H]`` of a grouped step (`hf_qsa_cache.grouped`: ``input_ids``
        ``[1, T]``, the groups' rectangles one after the other; row ``b`` takes ``counts[b]`` real tokens). Text
        only, no extra outputs."""
        check_token_ids(input_ids, self.config.vocab_size)
        embeds = self.embed(input_ids)
        cache.check_model(self.config, embeds.dtype)
        with cache.grouped_step(groups, counts, embeds.device, group_ids(input_ids, groups)) as metas:
            return self.grouped_layers(embeds, group_parts(metas, groups), cache)

    def grouped_layers(self, embeds: torch.Tensor, parts: list[GroupPart], cache: QSAPagedCache) -> torch.Tensor:
        """Every layer and the final norm of a grouped step whose groups' metadata is built (``parts``): device work
        only, so a CUDA graph can record it (`DecodeGraphs.mixed_step`)."""
        hidden_states, residual, pending_conv = embeds, None, None
        for layer in self.layers:
            hidden_states, residual = layer.forward_grouped(hidden_states, parts, cache, residual, pending_conv)
            pending_conv = layer.mlp_sconv
        return per_group(cache, parts, lambda part, h, r: conv_add_norm(pending_conv, h, r, self.norm, cache,
                                                                         part.meta)[1], hidden_states, residual)


class InklingForCausalLM(InklingPagedPreTrainedModel, ContinuousBatchingMixin, PagedCacheGenerationMixin,
                         GenerationMixin):
    _tied_weights_keys = {}
    _tp_plan = {"lm_head": "rowwise_split_input"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: InklingTextConfig):
        super().__init__(config)
        self.model = InklingTextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def language_model(self) -> InklingTextModel:
        """The text model on the cache (the multimodal class holds it beside its vision and audio towers)."""
        return self.model

    @lands_whole
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: QSAPagedCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> InklingCausalLMOutputWithPast:
        config = self.language_model.config
        if output_attentions is None:
            output_attentions = getattr(config, "output_attentions", False)
        if output_router_logits is None:
            output_router_logits = getattr(config, "output_router_logits", False)
        extra = labels is not None or bool(output_hidden_states) or output_attentions or output_router_logits
        graphs = decode_graphs_for(self, past_key_values, input_ids, inputs_embeds, extra_outputs=extra,
                                   logits_to_keep=logits_to_keep)
        if graphs is not None:
            logits = slice_logits_to_keep(graphs.step(input_ids, position_ids, attention_mask), logits_to_keep)
            out = InklingCausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)
            return out if return_dict is not False else out.to_tuple()
        outputs = self._run_model(
            model=self.language_model,
            input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            past_key_values=past_key_values, logits_to_keep=logits_to_keep,
            # Per-position outputs (loss, hidden states, attentions, router logits) need the whole prompt in one step.
            chunkable=not extra,
            per_token={"position_ids": position_ids, "token_ids": kwargs.pop("token_ids", None)},
            use_cache=use_cache, output_hidden_states=output_hidden_states, output_attentions=output_attentions,
            output_router_logits=output_router_logits,
        )
        logits = self._logits(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **kwargs)
        out = InklingCausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            router_logits=outputs.router_logits if output_router_logits else None,
        )
        return out if return_dict is not False else out.to_tuple()

    def grouped_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of a grouped step's last hidden states (`hf_qsa_cache.grouped.grouped_logits`)."""
        return self._logits(hidden_states)

    def _grouped_logits(self, input_ids, parts: list[GroupPart], cache: QSAPagedCache, keep: torch.Tensor):
        """Logits at the token indices ``keep`` of a grouped step whose groups' metadata is built (what a recorded
        mixed step runs: `DecodeGraphs.mixed_step`)."""
        embeds = self.language_model.embed(input_ids)
        return self._logits(self.language_model.grouped_layers(embeds, parts, cache)[0, keep])

    def _logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        config = self.language_model.config
        logits = self.lm_head(hidden_states / config.logits_mup_width_multiplier)
        unpadded = config.unpadded_vocab_size
        if unpadded is not None and unpadded < logits.shape[-1]:
            logits = logits[..., :unpadded]
        return logits

    def _get_candidate_generator(self, generation_config, **kwargs):
        # use_mtp drafts with MTP layers built from transformers' decoder layer (inkling_mtp.py); transformers
        # picks early exit and prompt lookup first, so do the same.
        if (generation_config.use_mtp and generation_config.assistant_early_exit is None
                and generation_config.prompt_lookup_num_tokens is None):
            from .inkling_mtp import InklingMTPCandidateGenerator

            return InklingMTPCandidateGenerator(self, generation_config, kwargs["model_kwargs"],
                                                kwargs.get("logits_processor"))
        return super()._get_candidate_generator(generation_config=generation_config, **kwargs)

    def _decode_logits(self, input_ids, position_ids, meta, cache: QSAPagedCache, keep: int = 0) -> torch.Tensor:
        """Logits of a step whose metadata is built (what a captured decode graph runs): of its last ``keep``
        columns, or of all (0)."""
        text = self.language_model
        hidden = text.run_layers(text.embed(input_ids), cache, meta)
        return self._logits(hidden[:, -keep:] if keep else hidden)


# Convert checkpoint layouts as transformers does for its own Inkling classes (if it has conversions).
use_upstream_conversions(InklingTextConfig.model_type)

__all__ = ["InklingForCausalLM", "InklingTextModel"]
