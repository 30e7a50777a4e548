"""Qwen4Exp text model on `QSAPagedCache`: drop-in for transformers' classes (same config, same names).

Building blocks that never touch the cache (MoE, hyper-connections, norms, rotary, GatedDeltaNet
math) are transformers' own. Every path that reads or writes cached state is written here:

* `PagedQSAAttention`: main K/V into paged blocks; the indexer pools each closed group once into
  the compressed store, scores only visible compressed groups, keeps the top ``budget / r`` and the
  open-group tail; attention reads only those tokens.
* `PagedGatedDeltaNet`: conv window and recurrent state per cache row.
* `PagedPLELayer`: n-gram context and dilated short-conv window per cache row.

Rows are ragged and may be padded anywhere (a step whose pads follow real tokens is reordered so each
row's pads come first: `hf_qsa_cache.padding`): pad tokens are inert (masked to zero before every
recurrence, never written), so each row's result is the one upstream computes on that row alone.
"""


import torch
from torch import nn
from transformers.generation import GenerationMixin
from transformers.integrations.accelerate import force_accelerate_hooks
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.qwen4_exp import modeling_qwen4_exp as upstream
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
from transformers.utils import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, _active_collector, capture_outputs

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.attentions import StepWeights, keeps_caller_columns, returns_weights, step_columns
from hf_qsa_cache.cuda_graphs import decode_graphs_for
from hf_qsa_cache.generation import (
    PagedCacheGenerationMixin, check_token_ids, forward_cache, lands_whole,
)
from hf_qsa_cache.grouped import GroupPart, group_ids, group_parts, per_group
from hf_qsa_cache.padding import on_output_path, runs_any_padding
from hf_qsa_cache.step import RowGroup
from hf_qsa_cache.serving import ContinuousBatchingMixin
from hf_qsa_cache.ops import hyper_connection, records_grad
from hf_qsa_cache.ops.gated_delta import chunked_rule, recurrence, short_conv
from hf_qsa_cache.ops.hyper_connection import add_injection, gated_residual
from hf_qsa_cache.ops.linears import project, project_alone
from hf_qsa_cache.ops.experts import default_experts_implementation
from hf_qsa_cache.ops.moe import qwen4_exp_moe
from hf_qsa_cache.ops.norm_rope import norm_rope
from hf_qsa_cache.ops.ple import ple_layer
from hf_qsa_cache.ops.qsa import (
    gated_sparse_paged_attention, paged_rows, qsa_index_step, sparse_paged_attention_probs,
)
from hf_qsa_cache.ops.row_writes import RowWrites
from hf_qsa_cache.rollback import gated_delta_keeping_states, step_history

from .checkpoints import StrictLoadingMixin, use_upstream_conversions


def _eos_id(config) -> int:
    eos = config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


class PagedQSAAttention(upstream.Qwen4ExpTextAttention):
    """Gated GQA restricted to the tokens the QSA indexer selects, over paged K/V."""

    def forward(self, hidden_states, cos, sin, positions3, cache: QSAPagedCache, attentions: StepWeights | None = None):
        """``attentions``: when given, this layer appends its attention probabilities ``[B, H, L, W]`` in the
        caller's columns (`sparse_paged_attention_probs`, `hf_qsa_cache.attentions`); while autograd records, its
        output is computed from them."""
        B, L, _ = hidden_states.shape
        n = B * L
        meta = cache.step_metadata(hidden_states.device)
        layer = cache.ensure_allocated(self.layer_idx, hidden_states.device, hidden_states.dtype)
        main = cache.tables["main"]
        x = hidden_states.reshape(n, -1)
        cos, sin = cos.reshape(n, -1), sin.reshape(n, -1)

        idx = self.indexer
        query, key, value, index_qk = project(x, self.q_proj, self.k_proj, self.v_proj, idx.index_qk_proj)
        query, gate = torch.chunk(query.view(n, -1, self.head_dim * 2), 2, dim=-1)  # gate: logits, a strided half
        query = norm_rope(self.q_norm, query, cos, sin)
        key = norm_rope(self.k_norm, key.view(n, -1, self.head_dim), cos, sin)
        value = value.view(n, -1, self.head_dim)
        writes = RowWrites()  # the layer's cache writes of the step: one launch where fused (`qsa_index_step` flushes)
        layer.kv.write(meta.slots["main"], key, value, writes)

        # ---- indexer: queries, raw keys, compress closed groups, commit the ring, select
        q_index, raw_keys = torch.split(index_qk, [idx.index_n_heads * idx.index_head_dim, idx.index_head_dim], dim=-1)
        q_index = norm_rope(idx.q_layernorm, q_index.view(n, idx.index_n_heads, idx.index_head_dim), cos, sin)

        selected = qsa_index_step(
            q_index, raw_keys, positions3, meta, layer.index.rows_from(meta.row_offset), main.block_size,
            idx.block_topk,
            finish_group=lambda pooled, first_pos: self._finish_group(pooled, first_pos, meta), writes=writes,
        )
        pages, scales = (layer.kv.keys, layer.kv.values), layer.kv.scales()  # scales: an fp8 store's, else {}
        if records_grad(key, value):  # the pages keep values only; autograd needs this step's keys as computed
            pages, scales = layer.kv.with_step_written(meta.slots["main"], key, value), {}
        if attentions is None:
            out = gated_sparse_paged_attention(
                query, *pages, meta.block_tables["main"], meta.token_row, selected, main.block_size, self.scaling,
                gate, **scales,
            )
        else:
            out = self._attention_returning_weights(query, pages, selected, gate, meta, main.block_size, attentions,
                                                   B, L, scales)
        return project_alone(out, self.o_proj).view(B, L, -1)

    def _attention_returning_weights(self, query, pages, selected, gate, meta, block_size: int,
                                     attentions: StepWeights, B: int, L: int, scales: dict) -> torch.Tensor:
        """The attention output ``[B*L, H*D]``, its weights appended to ``attentions`` in the caller's columns.
        While autograd records, the output is the returned weights times the values (`StepColumns.output`), so
        that it depends on them as transformers' eager attention does; otherwise the usual op computes it."""
        main = meta.block_tables["main"]
        probs = sparse_paged_attention_probs(query, pages[0], main, meta.token_row, selected, block_size,
                                             self.scaling, meta.max_seq_len, scales.get("key_scales"))
        columns = attentions.columns
        weights = columns.to_caller(probs.view(B, L, *probs.shape[1:]))
        attentions.append(weights)
        if not records_grad(weights):
            return gated_sparse_paged_attention(query, *pages, main, meta.token_row, selected, block_size,
                                                self.scaling, gate, **scales)
        flat_values = pages[1].view(-1, self.config.num_key_value_heads, self.head_dim)
        rows = meta.token_row.view(B, L)[:, :1].long()
        values = columns.values_at(lambda position: flat_values[paged_rows(main, rows, position, block_size)])
        out = columns.output(weights, values, meta.valid.view(B, L))
        return out.reshape(B * L, -1) * torch.sigmoid(gate).reshape(B * L, -1)

    def _finish_group(self, pooled: torch.Tensor, first_pos: torch.Tensor, meta) -> torch.Tensor:
        """A closed group's compressed key: its mean raw key, normed, rotated at its first position. The
        groups and their first positions are the same in every QSA layer of a step, and the rotary module is
        shared: its cos/sin are computed once per step (about ten launches per layer saved)."""
        g_cos, g_sin = meta.derived(("group_rotary", id(self.rotary_emb), pooled.device, pooled.dtype),
                                    lambda: self._rotary(pooled, first_pos))
        return norm_rope(self.indexer.k_layernorm, pooled[:, None], g_cos, g_sin)[:, 0]

    def _rotary(self, like: torch.Tensor, positions3: torch.Tensor):
        """cos/sin ``[W, rot]`` at explicit 3-axis positions ``[W, 3]``."""
        cos, sin = self.rotary_emb(like, positions3.t()[:, None, :])
        # The shared rotary module may sit on another GPU of a split model.
        return cos[0].to(like.device), sin[0].to(like.device)


class PagedGatedDeltaNet(upstream.Qwen4ExpTextGatedDeltaNet):
    """GatedDeltaNet whose conv window and recurrent state live in the cache, one row per sequence."""

    @force_accelerate_hooks("conv1d")  # its weight is read directly; offloading hooks must load it first
    def forward(self, hidden_states, valid, cache: QSAPagedCache):
        B, L, _ = hidden_states.shape
        meta = cache.step_metadata(hidden_states.device)
        layer = cache.ensure_allocated(self.layer_idx, hidden_states.device, hidden_states.dtype)
        state = layer.linear.rows_from(meta.row_offset)  # this step's (or row group's) rows from its row 0
        # Pads read as zeros (their projections are zeros), in the fused projections' loads.
        mixed_qkv, z, b, a = project(hidden_states, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a,
                                     keep=valid)
        mixed_qkv = mixed_qkv.transpose(1, 2)  # [B, C, L]
        z = z.reshape(B, L, -1, self.head_v_dim)

        # Causal depthwise conv over [last K-1 inputs | this step's real inputs] (pads are zero and moved
        # in front of the kept inputs).
        weight = self.conv1d.weight.squeeze(1)
        kept = step_history(cache, state, hidden_states.device, B, L)  # rollback ring (speculative decoding)
        mixed_qkv, one_step = short_conv(state, mixed_qkv, weight, self.activation, meta.leading_pads(),
                                         meta.starts_fresh, kept, hidden_states.dtype)

        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(B, L, -1, self.head_k_dim)
        key = key.reshape(B, L, -1, self.head_k_dim)
        value = value.reshape(B, L, -1, self.head_v_dim)

        def delta_rule(g, beta):  # upstream's recurrence over the step; the rollback ring keeps its states
            states = None
            initial_state = state.initial_recurrent(B, meta.starts_fresh)
            if kept is None:
                if L == 1:
                    core, last_state = upstream.torch_recurrent_gated_delta_rule(
                        query, key, value, g=g, beta=beta, initial_state=initial_state,
                        output_final_state=True, use_qk_l2norm_in_kernel=True,
                    )
                else:  # (rows packed into one batch where the kernel takes them: no autotuning per shape)
                    core, last_state = chunked_rule(upstream.torch_chunk_gated_delta_rule, query, key, value, g, beta,
                                                    initial_state, meta)
            else:
                core, last_state, states = gated_delta_keeping_states(
                    upstream.torch_chunk_gated_delta_rule, upstream.torch_recurrent_gated_delta_rule, query, key,
                    value, g, beta, initial_state, keep=kept[0], meta=meta,
                )
            state.write_recurrent(last_state, kept, states)
            return core

        core = recurrence(state, self.norm, hidden_states, query, key, value, b, a, self.A_log, self.dt_bias, valid, z,
                          one_step, delta_rule)
        return project_alone(core, self.out_proj)


class PagedPLELayer(upstream.Qwen4ExpTextPLELayer):
    """PLE whose n-gram context and dilated conv window live in the cache."""

    def forward(self, hidden_states, input_ids, valid, cache: QSAPagedCache):
        B, L, _ = hidden_states.shape
        meta = cache.step_metadata(hidden_states.device)
        layer = cache.ensure_allocated(self.layer_idx, hidden_states.device, hidden_states.dtype)
        state = layer.linear.rows_from(meta.row_offset)  # this step's (or row group's) rows from its row 0
        kept = step_history(cache, state, hidden_states.device, B, L)  # rollback ring (speculative decoding)
        # The lookup and the gating in one launch each where fused (hf_qsa_cache.ops.ple).
        history = self._ngram_history(input_ids, state, kept, meta)
        return ple_layer(self, history, hidden_states, valid, state, kept, meta)

    def _ngram_history(self, input_ids, state, kept, meta):
        """``[cached ids | this step's ids]`` per row; the cache keeps its tail for the next step."""
        history = state.window("ngram_ids", input_ids.long(), meta.leading_pads(), meta.starts_fresh)
        state.write_window("ngram_ids", history, kept)
        return history


class Qwen4ExpTextSparseMoeBlock(upstream.Qwen4ExpTextSparseMoeBlock):
    """transformers' MoE block (same modules and parameters); its routing, projection included, runs
    as two launches where fused (`hf_qsa_cache.ops.router`), its shared expert inside the selected or tiled
    experts' kernels where folded (`hf_qsa_cache.ops.experts.shared_expert_to_fold`), and its experts as the
    config's experts implementation says (`hf_qsa_cache.ops.moe`). Otherwise upstream's forward."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return qwen4_exp_moe(self, hidden_states, super().forward)


class Qwen4ExpTextDecoderLayer(upstream.Qwen4ExpTextDecoderLayer):
    def __init__(self, config: Qwen4ExpTextConfig, layer_idx: int):
        nn.Module.__init__(self)
        self.gradient_checkpointing = False
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = PagedGatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = PagedQSAAttention(config, layer_idx)
            self.self_attn.rotary_emb = None  # set by the text model (shared module, not a parameter)
        self.mlp = Qwen4ExpTextSparseMoeBlock(config)
        ple_ids = config.ple_layer_ids or []
        self.ple = (
            PagedPLELayer(config, layer_idx, ple_ids.index(layer_idx + 1)) if layer_idx + 1 in ple_ids else None
        )
        self.attn_hyper_connection = upstream.Qwen4ExpTextGatedResidual(config)
        self.mlp_hyper_connection = upstream.Qwen4ExpTextGatedResidual(config)

    def forward(self, hidden_states, cos, sin, positions3, valid, ple_input_ids, cache, meta, attentions=None,
                residual=None, defer_residual=False):
        """The layer on the hyper-connection streams ``hidden_states``. ``residual = (out, inject)``: the previous
        layer's MoE output, still to be added into the streams (upstream adds it at that layer's end). With
        ``defer_residual``, returns ``(streams, (out, inject))`` with this layer's own left pending in turn
        (`defers_residual`); otherwise the streams with it added."""
        with cache.replaying(meta):  # activation checkpointing may rerun this layer after the step
            return self._forward(hidden_states, cos, sin, positions3, valid, ple_input_ids, cache, attentions,
                                 residual, defer_residual)

    def _forward(self, hidden_states, cos, sin, positions3, valid, ple_input_ids, cache, attentions, residual,
                 defer_residual):
        if self.ple is not None:
            if residual is not None:
                hidden_states, residual = add_injection(hidden_states, *residual), None
            hidden_states = hidden_states + self.ple(hidden_states, ple_input_ids, valid, cache)
        # The previous layer's residual add and this mixing in one pass where fused.
        block_input, hyper_input, inject = gated_residual(self.attn_hyper_connection, hidden_states, residual)
        if self.layer_type == "linear_attention":
            out = self.linear_attn(block_input, valid, cache)
        else:
            out = self.self_attn(block_input, cos, sin, positions3, cache, attentions)
        # The attention block's residual add and the MoE block's mixing in one pass where fused.
        block_input, hyper_input, inject = gated_residual(self.mlp_hyper_connection, hyper_input, (out, inject))
        out = self.mlp(block_input)
        if defer_residual:
            return hyper_input, (out, inject)
        return add_injection(hyper_input, out, inject)

    def forward_grouped(self, hidden_states, parts: list[GroupPart], cache, residual=None):
        """The layer on a grouped step's streams ``[1, T, hc * H]`` (`hf_qsa_cache.grouped`): PLE and the mixer
        (attention or GatedDeltaNet) one group at a time, the rest over every token at once. Returns ``(streams,
        (out, inject))``, this layer's MoE residual left to the next layer (`defers_residual`)."""
        if self.ple is not None:
            if residual is not None:
                hidden_states, residual = add_injection(hidden_states, *residual), None
            hidden_states = hidden_states + per_group(
                cache, parts, lambda part, h: self.ple(h, part.extra["ple_ids"], part.extra["valid"], cache),
                hidden_states)
        block_input, hyper_input, inject = gated_residual(self.attn_hyper_connection, hidden_states, residual)
        if self.layer_type == "linear_attention":
            out = per_group(cache, parts, lambda part, x: self.linear_attn(x, part.extra["valid"], cache), block_input)
        else:
            out = per_group(cache, parts, lambda part, x: self.self_attn(
                x, part.extra["cos"], part.extra["sin"], part.extra["positions3"], cache), block_input)
        block_input, hyper_input, inject = gated_residual(self.mlp_hyper_connection, hyper_input, (out, inject))
        return hyper_input, (self.mlp(block_input), inject)


def defers_residual(layer: Qwen4ExpTextDecoderLayer, streams: torch.Tensor) -> bool:
    """Whether the layer loop leaves ``layer``'s MoE residual for the next layer's fused norm to add (one launch
    a layer less): with the ``hc`` fusion on, autograd not recording (the fused norm runs only then, and
    activation checkpointing tracks only a layer's tensor arguments), and nothing outside that must see the
    layer's output whole (`_output_seen`)."""
    return hyper_connection.defers_residual(layer, streams, _output_seen)


def _output_seen(layer: nn.Module) -> bool:
    """Whether a hook sees ``layer``'s output: accelerate's device hooks, a user's hook, or transformers' output
    recorder while it collects hidden states (it stays installed after an ``output_hidden_states`` call and
    is idle in the calls that do not ask for them)."""
    if hasattr(layer, "_hf_hook") or layer._forward_pre_hooks:
        return True
    if any(getattr(hook, "__name__", "") != "output_capturing_hook" for hook in layer._forward_hooks.values()):
        return True
    collecting = _active_collector.get() if layer._forward_hooks else None
    return collecting is not None and "hidden_states" in collecting


class Qwen4ExpPreTrainedModel(StrictLoadingMixin, upstream.Qwen4ExpPreTrainedModel):
    config_class = Qwen4ExpTextConfig
    _no_split_modules = ["Qwen4ExpTextDecoderLayer"]
    _can_record_outputs = None
    # The experts are transformers' own module, so its experts implementations (eager, grouped_mm, ...)
    # apply unchanged; attention never goes through the attention-function registry.
    _can_set_experts_implementation_cached_value = True
    _can_set_attn_implementation_cached_value = True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """Ours (``"hf_qsa"``, `hf_qsa_cache.ops.experts.OURS`) unless the user names another, which transformers
        checks and which then runs as named."""
        return default_experts_implementation(requested_experts) or super().get_correct_experts_implementation(
            requested_experts)
    # Upstream marks Qwen4Exp stateful, which makes generate() refuse assisted decoding. A QSAPagedCache with
    # num_speculative_tokens rolls every state back exactly (hf_qsa_cache/rollback.py), and generate()
    # builds (or checks) the cache with that headroom.
    _is_stateful = False


def _positions3(position_ids, meta, B: int, L: int, cache: QSAPagedCache) -> torch.Tensor:
    """RoPE positions ``[3, B, L]`` (T, H, W). Defaults to each row's logical positions plus its multimodal
    offset (`QSAPagedCache.rope_deltas`: text after an image continues where the image's positions end)."""
    if position_ids is not None:
        return step_position_ids(position_ids, B, L)
    position = meta.position.clamp_min(0)
    if any(cache.rope_deltas[meta.rows]):
        deltas = torch.tensor(cache.rope_deltas[meta.rows], dtype=position.dtype).to(position.device,
                                                                                    non_blocking=True)
        position = position + deltas[meta.token_row.long()]
    return position.view(1, B, L).expand(3, B, L)


def step_position_ids(position_ids: torch.Tensor, B: int, L: int) -> torch.Tensor:
    """The ``[3, B, L]`` positions of this step's ``L`` columns from what a caller passed: ``[B, T]``
    (text positions, ``T >= L``: the whole sequence's are fine) or ``[3 | 4, B, T]`` (MRoPE, with or
    without the text row)."""
    if position_ids.dim() == 2:
        return position_ids.view(1, B, -1)[..., -L:].expand(3, B, L)
    if position_ids.shape[0] == 4:  # text row + three MRoPE rows
        position_ids = position_ids[1:]
    return position_ids[..., -L:].expand(3, B, L)


# What a step with pads after real tokens reorders (`runs_any_padding`): inputs -> column dim; outputs ->
# (column dim, batch dim[, key column dim]).
TOKEN_INPUTS = {"input_ids": -1, "inputs_embeds": 1, "position_ids": -1, "ple_input_ids": -1}
# (Attention weights come back in the caller's columns from the layers themselves: `hf_qsa_cache.attentions`.)
TOKEN_OUTPUTS = {"last_hidden_state": (1, 0), "hidden_states": (1, 0), "router_logits": (1, 0)}


class Qwen4ExpTextModel(Qwen4ExpPreTrainedModel):
    # As upstream: output_hidden_states / output_router_logits record these modules' outputs.
    _can_record_outputs = {
        "router_logits": OutputRecorder(upstream.Qwen4ExpTextTopKRouter, index=0),
        "hidden_states": Qwen4ExpTextDecoderLayer,
    }

    def __init__(self, config: Qwen4ExpTextConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [Qwen4ExpTextDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.rotary_emb = upstream.Qwen4ExpTextRotaryEmbedding(config=config)
        for layer in self.layers:
            if layer.layer_type != "linear_attention":
                object.__setattr__(layer.self_attn, "rotary_emb", self.rotary_emb)
        self.hyper_connection_mixer = upstream.Qwen4ExpTextGatedResidual(config, use_combine=False)
        self.gradient_checkpointing = False
        self.post_init()

    @can_return_tuple  # outermost: the decorators below reorder and fill the output's fields
    @lands_whole
    @keeps_caller_columns
    @runs_any_padding(per_token=TOKEN_INPUTS, outputs=TOKEN_OUTPUTS)
    @capture_outputs
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, ple_input_ids=None, rope_deltas=None, output_attentions=None,
                **kwargs) -> MoeModelOutputWithPast:
        """``rope_deltas``: each row's multimodal RoPE offset after this step (`QSAPagedCache.rope_deltas`; set
        by the multimodal model for the rows whose media this step carries, None entries keep a row's)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            check_token_ids(input_ids, self.config.vocab_size)
            inputs_embeds = self.embed_tokens(input_ids)
        B, L = inputs_embeds.shape[:2]
        if self.config.ple_layer_ids and ple_input_ids is None:
            ple_input_ids = input_ids if input_ids is not None else upstream.Qwen4ExpTextModel.reverse_embedding(
                self, inputs_embeds)
        # The ids the embeddings stand for (PLE's ids when running from embeddings) are logged for check_continues.
        token_ids = input_ids if input_ids is not None else ple_input_ids
        # Without a cache from the caller the forward still runs on paged state, sized for this call.
        cache, use_cache = forward_cache(self, past_key_values, B, L, use_cache)
        cache.check_model(self.config, inputs_embeds.dtype)
        if output_attentions is None:
            output_attentions = getattr(self.config, "output_attentions", False)
        weights = output_attentions and returns_weights(self.config)
        attentions = None
        with cache.step(B, L, attention_mask, inputs_embeds.device, token_ids, rope_deltas) as meta:
            if weights:  # as upstream: QSA layers only, [B, heads, L, the mask's columns]
                attentions = StepWeights(step_columns(attention_mask, B, L, meta.max_seq_len, inputs_embeds.device))
            hidden_states = self.run_layers(inputs_embeds, ple_input_ids, position_ids, meta, cache, attentions)
        if output_attentions:  # an empty tuple where transformers' attention returns no weights
            attentions = tuple(attentions or ())
        return MoeModelOutputWithPast(
            last_hidden_state=hidden_states, past_key_values=cache if use_cache is not False else None,
            attentions=attentions,
        )

    def layer_inputs(self, embeds, ple_input_ids, position_ids, meta, cache: QSAPagedCache) -> dict:
        """What every layer of a step (or of a grouped step's group) reads, computed once: its real tokens
        (``valid``), RoPE's ``cos`` / ``sin`` and flat ``positions3``, and PLE's ids (``ple_ids``, pads read as eos;
        None without PLE ids)."""
        B, L = embeds.shape[:2]
        valid = meta.valid.view(B, L)
        ple_ids = None if ple_input_ids is None else torch.where(valid, ple_input_ids, _eos_id(self.config))
        positions3 = _positions3(position_ids, meta, B, L, cache)
        cos, sin = self.rotary_emb(embeds, positions3)
        return {"valid": valid, "cos": cos, "sin": sin, "positions3": positions3.reshape(3, -1).t(),
                "ple_ids": ple_ids}

    def run_layers(self, inputs_embeds, ple_input_ids, position_ids, meta, cache: QSAPagedCache,
                   attentions: list | None = None) -> torch.Tensor:
        """Every layer and the final mixer over this step's embeddings (device work only: the step's
        metadata is built, so a CUDA graph can record this). Each QSA layer appends its attention
        probabilities by key position to ``attentions`` when given."""
        inputs = self.layer_inputs(inputs_embeds, ple_input_ids, position_ids, meta, cache)
        cos, sin, valid = inputs["cos"], inputs["sin"], inputs["valid"]
        flat_positions3, ple_input_ids = inputs["positions3"], inputs["ple_ids"]
        hidden_states = inputs_embeds.repeat(1, 1, self.config.hc_count)
        # Layer inputs and outputs that transformers' recorder keeps as hidden states: on the outputs' autograd path
        # on reordered steps too (`on_output_path`), so retain_grad() on them works.
        collecting = _active_collector.get()
        recorded = on_output_path if collecting is not None and "hidden_states" in collecting else None
        if recorded is not None:
            hidden_states = recorded(hidden_states)
        residual = None  # the last layer's MoE output and injection weights, not yet in the streams
        for layer in self.layers[: self.config.num_hidden_layers]:
            defer = defers_residual(layer, hidden_states)
            out = layer(hidden_states, cos, sin, flat_positions3, valid, ple_input_ids, cache, meta, attentions,
                        residual=residual, defer_residual=defer)
            hidden_states, residual = out if defer else (out, None)
            if recorded is not None:
                hidden_states = recorded(hidden_states)
        # The final mixer (with the last layer's residual, added in its fused norm's pass where fused).
        return gated_residual(self.hyper_connection_mixer, hidden_states, residual)[0]

    def forward_grouped(self, input_ids: torch.Tensor, cache: QSAPagedCache, groups: list[RowGroup],
                        counts: list[int]) -> torch.Tensor:
        """The last hidden state ``[1, T, H]`` of a grouped step (`hf_qsa_cache.grouped`: ``input_ids`` ``[1, T]``,
        the groups' rectangles one after the other; row ``b`` takes ``counts[b]`` real tokens). Text only, no
        extra outputs."""
        check_token_ids(input_ids, self.config.vocab_size)
        embeds = self.embed_tokens(input_ids)
        cache.check_model(self.config, embeds.dtype)
        with cache.grouped_step(groups, counts, embeds.device, group_ids(input_ids, groups)) as metas:
            return self.grouped_layers(input_ids, embeds, group_parts(metas, groups), cache)

    def grouped_layers(self, input_ids, embeds, parts: list[GroupPart], cache: QSAPagedCache) -> torch.Tensor:
        """Every layer and the final mixer of a grouped step whose groups' metadata is built (``parts``): device
        work only, so a CUDA graph can record it (`DecodeGraphs.mixed_step`)."""
        for part in parts:  # what every layer of a group reads, computed once
            ple_ids = part.view(input_ids) if self.config.ple_layer_ids else None
            part.extra.update(self.layer_inputs(part.view(embeds), ple_ids, None, part.meta, cache))
        hidden_states = embeds.repeat(1, 1, self.config.hc_count)
        residual = None
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, residual = layer.forward_grouped(hidden_states, parts, cache, residual)
        return gated_residual(self.hyper_connection_mixer, hidden_states, residual)[0]


class Qwen4ExpForCausalLM(Qwen4ExpPreTrainedModel, ContinuousBatchingMixin, PagedCacheGenerationMixin, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: Qwen4ExpTextConfig):
        super().__init__(config)
        self.model = Qwen4ExpTextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def language_model(self) -> Qwen4ExpTextModel:
        """The text model on the cache (the multimodal class holds it under its vision tower's model)."""
        return self.model

    @can_return_tuple
    @lands_whole
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_router_logits=None,
                output_hidden_states=None, output_attentions=None, logits_to_keep=0, **kwargs) -> MoeCausalLMOutputWithPast:
        config = self.language_model.config
        if output_router_logits is None:
            output_router_logits = config.output_router_logits
        if output_hidden_states is None:
            output_hidden_states = config.output_hidden_states
        if output_attentions is None:
            output_attentions = getattr(config, "output_attentions", False)
        graphs = decode_graphs_for(self, past_key_values, input_ids, inputs_embeds,
                                   extra_outputs=labels is not None or output_hidden_states or output_router_logits
                                   or output_attentions or "ple_input_ids" in kwargs or "rope_deltas" in kwargs,
                                   logits_to_keep=logits_to_keep)
        if graphs is not None:
            logits = slice_logits_to_keep(graphs.step(input_ids, position_ids, attention_mask), logits_to_keep)
            return MoeCausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)
        outputs = self._run_model(
            model=self.language_model, rope_deltas=kwargs.pop("rope_deltas", None),
            input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            past_key_values=past_key_values, logits_to_keep=logits_to_keep,
            # Per-position outputs (loss, hidden states, router logits, attentions) need the whole prompt in one
            # forward.
            chunkable=labels is None and not (output_hidden_states or output_router_logits or output_attentions),
            per_token={"position_ids": position_ids, "ple_input_ids": kwargs.pop("ple_input_ids", None)},
            use_cache=use_cache, output_router_logits=output_router_logits, output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, config.vocab_size, **kwargs)
        aux_loss = None
        if output_router_logits:
            aux_loss = upstream.load_balancing_loss_func(
                outputs.router_logits, config.num_experts, config.num_experts_per_tok, attention_mask
            )
            if labels is not None:
                loss = loss + config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(
            loss=loss, aux_loss=aux_loss, logits=logits, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions, router_logits=outputs.router_logits,
        )

    def grouped_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of a grouped step's last hidden states (`hf_qsa_cache.grouped.grouped_logits`)."""
        return self.lm_head(hidden_states)

    def _grouped_logits(self, input_ids, parts: list[GroupPart], cache: QSAPagedCache, keep: torch.Tensor):
        """Logits at the token indices ``keep`` of a grouped step whose groups' metadata is built (what a recorded
        mixed step runs: `DecodeGraphs.mixed_step`)."""
        embeds = self.language_model.embed_tokens(input_ids)
        return self.grouped_head(self.language_model.grouped_layers(input_ids, embeds, parts, cache)[0, keep])

    _decode_uses_position_ids = True  # the CUDA-graph decode step keeps a position buffer
    step_positions = staticmethod(step_position_ids)  # what it writes there from a caller's position_ids

    def _decode_logits(self, input_ids, position_ids, meta, cache: QSAPagedCache, keep: int = 0) -> torch.Tensor:
        """Logits of a step whose metadata is built (what a captured decode graph runs): of its last ``keep``
        columns, or of all (0)."""
        embeds = self.language_model.embed_tokens(input_ids)
        hidden = self.language_model.run_layers(embeds, input_ids, position_ids, meta, cache)
        return self.lm_head(hidden[:, -keep:] if keep else hidden)


# Upstream checkpoints store experts per expert and the n-gram table in shards: convert as upstream does.
use_upstream_conversions(Qwen4ExpTextConfig.model_type)

__all__ = ["Qwen4ExpForCausalLM", "Qwen4ExpTextModel", "Qwen4ExpPreTrainedModel"]
