"""Each fusion's Triton kernel against its torch specification at the benchmark shapes (bf16, CUDA):
the largest difference and the time of both, one line per kernel.

    python benchmarks/check_fused_kernels.py
    python benchmarks/check_fused_kernels.py --conv-sweep   # the prompt conv kernel's blocks, 1 x 16384 tokens
    python benchmarks/check_fused_kernels.py --conv-norm-sweep   # the conv_norm kernels' warps, 1 and 32 tokens
    python benchmarks/check_fused_kernels.py --experts-sweep   # the tiled experts' tiles, 17 to 64 tokens
    TRITON_INTERPRET=1 python benchmarks/check_fused_kernels.py --device cpu --small   # logic check (CI)

Shapes are those of `bench_generate.py`'s configs at a decode step of ``--tokens`` tokens (hidden 2048, 4
hyper-connection streams, 32 GatedDeltaNet value heads of 128, QSA heads of 256 and index heads of 128 with a
quarter rotated, 64 experts of 512 routed 10 per token). ``--small`` shrinks them for the interpreter.
tests/gpu/test_gpu_fused_kernels.py runs the same comparisons (`compared`) at 1, 8 and 32 tokens, untimed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generate import emit  # noqa: E402
from sweep_experts_tiles import graph_time_us  # noqa: E402

from hf_qsa_cache.ops import experts, gated_delta, hyper_connection, inkling_router  # noqa: E402
from hf_qsa_cache.ops import norm_rope, prompt_experts, qsa, rms_norm, router  # noqa: E402
from hf_qsa_cache.ops import experts_triton, gated_delta_triton, hyper_connection_triton  # noqa: E402
from hf_qsa_cache.ops import inkling_router_triton, norm_rope_triton, qsa_triton, rms_norm_triton  # noqa: E402
from hf_qsa_cache.ops import linears, linears_triton, prompt_experts_triton, router_triton  # noqa: E402
from hf_qsa_cache.ops import conv_norm, conv_norm_triton, ple, ple_triton, top_set_triton  # noqa: E402
from hf_qsa_cache.ops import row_writes, row_writes_triton, selected_positions_triton, top_set  # noqa: E402
from hf_qsa_cache import fusions  # noqa: E402
from hf_qsa_cache.ops.sconv import ConvTaps  # noqa: E402


def _time(fn, device, repeat: int) -> float:
    """Median microseconds of ``fn()`` (on CUDA, with a synchronisation around each call)."""
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def _diff(a, b) -> float:
    """Largest difference, relative to the value where it exceeds 1 (a bf16 unit in the last place is 2^-8
    of the value; integer outputs must be equal)."""
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return max(((x.float() - y.float()).abs() / y.float().abs().clamp_min(1)).max().item() if x.numel() else 0.0
               for x, y in pairs)


def cases(device, dtype, tokens: int, small: bool):
    """``(name, kernel call, spec call, tolerance)`` per fused kernel."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    H, hc, Hv, Dv, heads, head_dim, index_heads, index_dim, E, k, inter, C = (
        (40, 3, 3, 8, 4, 16, 4, 16, 8, 3, 24, 44) if small else (2048, 4, 32, 128, 16, 256, 32, 128, 64, 10, 512, 8192))
    streams, out, inject = rand(tokens, hc * H, scale=2), rand(tokens, H), rand(tokens, hc).abs()
    weight = rand(hc * H, scale=0.5)
    yield ("hc_norm (+ residual)",
           lambda: hyper_connection_triton.hc_norm_triton(streams, weight, hc, 1e-6, (out, inject)),
           lambda: _cpu(hyper_connection.hc_norm, streams, weight, hc, 1e-6, (out, inject)), 0.02)
    up = rand(tokens, hc * H)
    logits = rand(tokens, hc)
    yield ("mix_streams", lambda: hyper_connection_triton.mix_streams_triton(up, streams, logits, hc),
           lambda: _cpu(hyper_connection.mix_streams, up, streams, logits, hc), 0.02)
    # Qwen4Exp's PLE layer at the benchmark shapes (16 n-gram heads of 128 features, 32000 ids: hashes that
    # overflow int64), one window of ids per token with end-of-sequence ids in it.
    ple_layer = _ple_layer(small, device, dtype)
    emb = ple_layer.ple_embedding
    history = torch.randint(2, emb.unigram_vocab_size, (tokens, emb.ngram_size + 1), generator=g)
    history[torch.rand(history.shape, generator=g) < 0.2] = emb.eos_token_id
    history = history.to(device)
    yield ("ple ngram_embeddings", lambda: ple_triton.ngram_embeddings_triton(history, emb, 1),
           lambda: emb.ngram_embedding(ple.ngram_ids_torch(history, emb, 1)).flatten(-2), 0)
    ple_key, ple_value, ple_valid = rand(tokens, hc * H), rand(tokens, H), torch.arange(tokens, device=device) != 1
    ple_weights = (ple_layer.norm_key.weight, ple_layer.norm_query.weight, ple_layer.norm_conv.weight)
    yield ("ple gate",
           lambda: ple_triton.ple_gate_triton(ple_key, ple_value, streams, ple_valid, *ple_weights, hc, 1e-6),
           lambda: _cpu(ple.ple_gate_torch, ple_key, ple_value, streams, ple_valid, *ple_weights, hc, 1e-6), 0.02)
    R = 12 if small else 320  # hc_lowrank
    down, up_w, inject_w = rand(R, hc * H, scale=0.02), rand(hc * H, R, scale=0.1), rand(hc, hc * H, scale=0.02)
    normed = rand(tokens, hc * H)
    spec = lambda: _cpu(hyper_connection.mix_projections, normed, down, up_w, inject_w, hc)  # noqa: E731
    yield ("mix_projections", lambda: hyper_connection_triton.mix_projections_triton(normed, down, up_w, inject_w, hc),
           spec, 0.02)
    # What ``hc`` runs without ``hc_proj`` (GEMMs around two kernels): its time beside the line above.
    yield ("mix_with_linears (for its time)",
           lambda: hyper_connection.mix_with_linears(normed, down, up_w, inject_w, hc), spec, 0.05)
    b, a = rand(1, tokens, Hv, scale=3), rand(1, tokens, Hv, scale=3)
    A_log, dt_bias = rand(Hv), rand(Hv)
    valid = torch.ones(1, tokens, dtype=torch.bool, device=device)
    yield ("delta_gates", lambda: gated_delta_triton.delta_gates_triton(b, a, A_log, dt_bias, valid),
           lambda: _cpu(gated_delta.delta_gates, b, a, A_log, dt_bias, valid), 0.02)
    core, gate, norm_w = rand(tokens * Hv, Dv), rand(tokens * Hv, Dv), rand(Dv)
    yield ("gated_rms_norm", lambda: gated_delta_triton.gated_rms_norm_triton(core, gate, norm_w, 1e-6, "sigmoid"),
           lambda: _cpu(gated_delta.gated_rms_norm_torch, core, gate, norm_w, 1e-6, "sigmoid"), 0.02)
    # ``gdn_step``: the gates, the recurrence (state in place) and the gated norm of one token a row, at the bench's
    # 16 key heads of 128 serving 32 value heads of 128; the state compared too.
    Hk, Dk = (1, 16) if small else (16, 128)
    qkv = rand(tokens, 2 * Hk * Dk + Hv * Dv)
    q, kk = qkv[:, : Hk * Dk].unflatten(-1, (Hk, Dk)), qkv[:, Hk * Dk: 2 * Hk * Dk].unflatten(-1, (Hk, Dk))
    v, z = qkv[:, 2 * Hk * Dk:].unflatten(-1, (Hv, Dv)), rand(tokens, Hv, Dv)
    rec = rand(tokens, Hv, Dk, Dv, scale=0.3, dt=torch.float32)
    step_args = (q, kk, v, b[0], a[0], A_log, dt_bias, valid[0], z, norm_w, 1e-6, "sigmoid")
    yield ("recurrent_step (+ state)", lambda: _with_state(gated_delta_triton.recurrent_step_triton, rec, *step_args),
           lambda: _cpu(_with_state, gated_delta.recurrent_step_torch, rec, *step_args), 0.02)
    yield ("recurrent step unfused (for its time)", lambda: _with_state(_unfused_recurrent_step, rec, *step_args),
           lambda: _cpu(_with_state, gated_delta.recurrent_step_torch, rec, *step_args), 0.05)
    state, x, conv_w = rand(tokens, C, 3), rand(tokens, 1, C).transpose(1, 2), rand(C, 4)
    yield ("conv_decode_step", lambda: gated_delta_triton.conv_decode_step_triton(state.clone(), x, conv_w, dtype),
           lambda: _cpu(gated_delta.conv_decode_step, state.clone(), x, conv_w, dtype), 0.02)
    # A prompt chunk's conv (two rows, one left-padded): the kernel and the tail it keeps, then the window path
    # it replaces on the GPU (for its time).
    L = 9 if small else 4096
    state, x, pads = rand(2, C, 3), rand(2, L, C).transpose(1, 2), torch.tensor([0, 5], device=device)
    spec = lambda: _cpu(gated_delta.conv_prefill_torch, state.clone(), x, conv_w, pads, False, dtype)  # noqa: E731
    yield (f"conv_prefill 2x{L}", lambda: gated_delta.conv_prefill(state.clone(), x, conv_w, pads, False, dtype),
           spec, 0.02)
    yield (f"conv_prefill_torch 2x{L} (for its time)",
           lambda: gated_delta.conv_prefill_torch(state.clone(), x, conv_w, pads, False, dtype), spec, 0.02)
    # Inkling's convs with their norms (16 query heads, 4 key/value heads of 128, hidden 2048), one decode token a
    # row, its three taps in the store.
    iq, ikv, ihd = (3, 2, 8) if small else (16, 4, 128)
    k_taps, v_taps = _conv_taps_pair(tokens, ikv, ihd, rand, device)
    q_in, k_in, v_in = rand(tokens, iq * ihd, scale=2), rand(tokens, ikv * ihd, scale=2), rand(tokens, ikv * ihd)
    qn_w, kn_w = rand(ihd, scale=0.5), rand(ihd, scale=0.5)
    yield ("attention_inputs", lambda: conv_norm_triton.attention_inputs_triton(
        q_in, k_in, v_in, k_taps, v_taps, qn_w, 1e-6, kn_w, 1e-6, ihd), lambda: _cpu(
        conv_norm.attention_inputs_torch, q_in, k_in, v_in, k_taps, v_taps, qn_w, 1e-6, kn_w, 1e-6, ihd), 0.02)
    hidden_taps = _conv_taps_pair(tokens, ikv, H // ikv, rand, device)[0]
    hidden, res, rms_w = rand(tokens, H), rand(tokens, H), rand(H)
    yield ("conv_add_rms_norm",
           lambda: conv_norm_triton.conv_add_rms_norm_triton(hidden, hidden_taps, res, rms_w, 1e-6),
           lambda: _cpu(conv_norm.conv_add_rms_norm_torch, hidden, hidden_taps, res, rms_w, 1e-6), 0.02)
    yield ("add_rms_norm", lambda: rms_norm_triton.add_rms_norm_triton(hidden, res, rms_w, 1e-6),
           lambda: _cpu(rms_norm.add_rms_norm_torch, hidden, res, rms_w, 1e-6), 0.02)
    for n_heads, dim in ((heads, head_dim), (index_heads, index_dim)):
        q, nw = rand(tokens, n_heads, dim, scale=3), rand(dim, scale=0.5)
        angle = torch.rand(tokens, dim // 8, generator=g).to(device) * 50
        cos, sin = (torch.cat([f(angle), f(angle)], dim=-1).to(dtype) for f in (torch.cos, torch.sin))
        yield (f"norm_rope {n_heads}x{dim}", lambda q=q, nw=nw, cos=cos, sin=sin: norm_rope_triton.norm_rope_triton(
            q, nw, 1e-6, cos, sin), lambda q=q, nw=nw, cos=cos, sin=sin: _cpu(
            norm_rope.norm_rope_written_out, q, nw, 1e-6, cos, sin), 0.03)
    route_x, route_w = rand(tokens, H), rand(E, H, scale=0.05)
    # Experts are compared by the probability they carry: bf16 logits tie often, and among equal
    # probabilities torch's top-k order is open (the kernel takes the lower expert first).
    probs = torch.softmax((route_x.float() @ route_w.float().T).to(dtype).float(), dim=-1)

    def carried(result):
        weights, picked = result
        return weights, probs.gather(1, picked)

    yield ("route", lambda: carried(router_triton.route_triton(route_x, route_w, k, True)),
           lambda: carried(_cpu(router.route_torch, route_x, route_w, k, True)), 0.02)
    x_e = rand(tokens, H)
    gate_up, down = rand(E, 2 * inter, H, scale=0.02), rand(E, H, inter, scale=0.02)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(device)
    route_w = torch.rand(tokens, k, generator=g).to(device=device, dtype=dtype)
    yield ("selected_experts", lambda: experts_triton.selected_experts_triton(x_e, index, route_w, gate_up, down),
           lambda: _cpu(experts.selected_experts_torch, x_e, index, route_w, gate_up, down), 0.02)
    shared = experts.SharedExpert(rand(1, inter, H, scale=0.02), rand(1, inter, H, scale=0.02),
                                  rand(1, H, inter, scale=0.02), gate_vector=rand(1, H, scale=0.02))
    yield ("selected_experts + shared", lambda: experts_triton.selected_experts_triton(
        x_e, index, route_w, gate_up, down, False, shared), lambda: _cpu(
        experts.selected_experts_torch, x_e, index, route_w, gate_up, down, False, shared), 0.02)
    # Inkling's two shared experts, weighted per token by the router.
    two = experts.SharedExpert(rand(2, inter, H, scale=0.02), rand(2, inter, H, scale=0.02),
                               rand(2, H, inter, scale=0.02), token_weights=torch.rand(tokens, 2, generator=g).to(
                                   device=device, dtype=dtype))
    yield ("selected_experts + 2 shared", lambda: experts_triton.selected_experts_triton(
        x_e, index, route_w, gate_up, down, False, two), lambda: _cpu(
        experts.selected_experts_torch, x_e, index, route_w, gate_up, down, False, two), 0.02)
    # Inkling's router at its benchmark shapes: 64 routed experts and 2 shared, top 6.
    router_w, corr, g_scale = rand(E + 2, H, scale=0.02), torch.rand(E, generator=g).to(device) * 0.1, rand(1).abs()
    choice = (torch.sigmoid(x_e.float() @ router_w.float().T[:, :E]) + corr).cpu()

    def chosen(result):  # experts compared by their choice score, as route_topk's above
        weights, picked, gammas = result
        return weights, choice.gather(1, picked.cpu()).to(device), gammas

    yield ("inkling_router", lambda: chosen(inkling_router_triton.inkling_router_triton(
        x_e, router_w, corr, g_scale, 6, 2, 8.0)), lambda: chosen(_cpu(
        inkling_router.route_inkling_torch, x_e, router_w, corr, g_scale, 6, 2, 8.0)), 0.02)
    groups = torch.stack([torch.randperm(64, generator=g)[:16] for _ in range(tokens)]).to(device)
    visible = torch.full((tokens,), 40, device=device)
    position = torch.full((tokens,), 163, device=device)
    yield ("selected_positions", lambda: selected_positions_triton.selected_positions_triton(groups, visible, position, 4, 16),
           lambda: _cpu(qsa.selected_positions, groups, visible, position, 4, 16), 0)
    # ``qsa_writes``: a QSA layer's cache writes of a step in one launch (keys, values, a closed group's compressed
    # key, the ring's raw keys and int64 positions; a pad's slot -1 included): the stores after them compared.
    kv_heads, head_dim, index_dim = (2, 8, 8) if small else (2, 256, 128)
    slots = (torch.randperm(63, generator=g)[:tokens] + 1).to(device)  # row 0 only for the pad: no race there
    slots[-1] = -1
    flat = (rand(64, kv_heads, head_dim), slots, rand(tokens, kv_heads, head_dim),
            rand(64, kv_heads, head_dim), slots, rand(tokens, kv_heads, head_dim),
            rand(64, index_dim), slots[:1], rand(1, index_dim),
            rand(64, index_dim), slots.clamp_min(0), rand(tokens, index_dim),
            torch.zeros(64, 3, dtype=torch.int64, device=device), slots.clamp_min(0),
            torch.randint(0, 9999, (tokens, 3), generator=g).to(device))
    yield ("qsa_writes", lambda: _written(row_writes_triton.write_rows_triton, *flat),
           lambda: _cpu(_written, _written_torch, *flat), 0)
    # A QSA selection's top-k set at a 4400-token reach (1100 groups, k = 512; relu zeros and unseen -inf groups
    # included); "top_groups on device" times the torch path it replaces (a sorting top-k) on the same device.
    scores = torch.relu(rand(tokens, 40 if small else 1100, dt=torch.float32))
    scores[:, ::5] = float("-inf")
    pick = 10 if small else 512
    yield ("top_set", lambda: top_set_triton.top_set_triton(scores, pick),
           lambda: _cpu(lambda s: top_set.top_groups(s, pick).sort(dim=-1).values, scores), 0)
    yield ("top_groups on device", lambda: top_set.top_groups(scores, pick).sort(dim=-1).values,
           lambda: _cpu(lambda s: top_set.top_groups(s, pick).sort(dim=-1).values, scores), 0)
    long_scores = torch.relu(rand(tokens, 50 if small else 4400, dt=torch.float32))  # a 17600-token reach
    yield ("top_set 4400 groups", lambda: top_set_triton.top_set_triton(long_scores, pick),
           lambda: _cpu(lambda s: top_set.top_groups(s, pick).sort(dim=-1).values, long_scores), 0)
    # A graph step of 32 tokens' (token, expert) pairs grouped by expert ("torch on device": the path it replaces).
    pair_ids = torch.randint(0, E, (5 * k if small else 32 * k,), generator=g).to(device)
    yield ("pair_order", lambda: prompt_experts_triton.pair_order_triton(pair_ids, E),
           lambda: _cpu(prompt_experts.pair_order_torch, pair_ids, E), 0)
    yield ("pair_order torch on device", lambda: prompt_experts.pair_order_torch(pair_ids, E),
           lambda: _cpu(prompt_experts.pair_order_torch, pair_ids, E), 0)
    # A prompt chunk's experts (4096 tokens x k): the activation with its routing weight, and the sum by token.
    T = 5 if small else 4096
    gate_up, pair_w = rand(T * k, 2 * inter), torch.rand(T * k, generator=g).to(device)
    yield (f"weighted_silu_mul {T}x{k}", lambda: prompt_experts_triton.weighted_silu_mul_triton(gate_up, pair_w),
           lambda: _cpu(prompt_experts.weighted_silu_mul_torch, gate_up, pair_w), 0.02)
    pair_rows, positions = rand(T * k, H), torch.randperm(T * k, generator=g).to(device)
    yield (f"sum_by_token {T}x{k}", lambda: prompt_experts_triton.sum_by_token_triton(pair_rows, positions, T, k),
           lambda: _cpu(prompt_experts.sum_by_token_torch, pair_rows, positions, T, k), 0.02)
    # A graph step of 32 tokens' experts at Inkling's shapes (6 of 64 experts a token, two shared experts weighted
    # per token), tiled by expert, and what it replaces: transformers' grouped GEMMs and the shared experts' module
    # (the specification runs on the device: gathered per pair, it is gigabytes in fp32).
    moe_args = _experts_inputs(5 if small else 32, 3 if small else 6, E, H, inter, rand, g, device)
    spec = lambda: prompt_experts.tiled_experts_torch(*moe_args)  # noqa: E731
    name = f"{moe_args[0].shape[0]}x{moe_args[1].shape[1]} + 2 shared"
    yield (f"tiled_experts {name}", lambda: prompt_experts_triton.tiled_experts_triton(*moe_args), spec, 0.02)
    yield (f"grouped_experts {name} (for its time)", lambda: _grouped_gemm_experts(*moe_args), spec, 0.05)
    # GatedDeltaNet's four input projections in one launch (qkv, z, b, a), a pad token among several.
    x_in = rand(tokens, H)
    rows = (2 * 16 + 24, 24, 3, 3) if small else (2 * 16 * 128 + 2 * Dv * 32, 32 * Dv, 32, 32)
    projections = [rand(n, H, scale=0.02) for n in rows]
    keep = torch.arange(tokens, device=device) != 1
    yield ("projections", lambda: tuple(linears_triton.linears_triton(x_in, projections, keep)),
           lambda: tuple(_cpu(lambda *a: tuple(linears.linears_torch(a[0], list(a[1:-1]), a[-1])), x_in, *projections,
                              keep)), 0.02)


def compared(device, dtype, tokens: int, small: bool):
    """``(name, kernel call, largest difference, tolerance)`` per fused kernel: its output against its spec's."""
    for name, kernel, spec, tol in cases(device, dtype, tokens, small):
        yield name, kernel, _diff(kernel(), spec()), tol


def _experts_inputs(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, rand, g, device):
    """A step's experts arguments (`prompt_experts.tiled_experts_torch`): hidden states, routing (distinct experts
    per token, weights summing to 1), the experts' weights (untransposed), two shared experts with their weights
    per token (Inkling's)."""
    index = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=-1).indices.to(device)
    weights = torch.rand(tokens, top_k, generator=g)
    weights = (weights / weights.sum(-1, keepdim=True)).to(device, rand(1).dtype)
    shared = experts.SharedExpert(rand(2, inter, hidden, scale=0.02), rand(2, inter, hidden, scale=0.02),
                                  rand(2, hidden, inter, scale=0.02), token_weights=rand(tokens, 2).sigmoid())
    return (rand(tokens, hidden), index, weights, rand(num_experts, 2 * inter, hidden, scale=0.02),
            rand(num_experts, hidden, inter, scale=0.02), False, shared)


def _grouped_gemm_experts(x, index, weights, gate_up, down, transposed, shared):
    """What a graph step of more than 16 tokens runs without the ``tiled_experts`` fusion: transformers' grouped
    GEMMs (`prompt_experts.grouped_experts_forward`) and the shared experts as Inkling's module runs them."""
    from types import SimpleNamespace

    with fusions.fused(("tiled_experts",), on=False):
        module = SimpleNamespace(gate_up_proj=gate_up, down_proj=down, is_transposed=transposed)
        routed = prompt_experts.grouped_experts_forward(module, x, index, weights)
    stacked = x[None].expand(shared.gate.shape[0], -1, -1)
    activated = (torch.nn.functional.silu(torch.bmm(stacked, shared.gate.transpose(1, 2)))
                 * torch.bmm(stacked, shared.up.transpose(1, 2)) * shared.token_weights.T[..., None])
    return routed + torch.bmm(activated, shared.down.transpose(1, 2)).float().sum(dim=0).to(x.dtype)


def experts_sweep(device, jsonl) -> None:
    """The tiled experts' tiles at Inkling's shapes (64 experts of 512, top 6, two shared experts, hidden 2048;
    bf16) for graph steps of 8 to 64 tokens, each checked against the default tiles' output and graph-timed,
    beside what graph steps run today: the selected experts' kernels up to 16 tokens, transformers' grouped
    GEMMs and the shared experts' module past that."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16)

    for tokens in (8, 16, 17, 32, 64):
        args = _experts_inputs(tokens, 6, 64, 2048, 512, rand, g, device)
        want = prompt_experts_triton.tiled_experts_triton(*args)
        emit({"kernel": "experts sweep", "tokens": tokens, "path": "grouped_mm",
              "kernel_us": round(graph_time_us(lambda: _grouped_gemm_experts(*args)), 1)}, jsonl)
        if tokens <= 16:
            emit({"kernel": "experts sweep", "tokens": tokens, "path": "selected",
                  "kernel_us": round(graph_time_us(lambda: experts_triton.selected_experts_triton(*args)), 1),
                  "max_diff": _diff(experts_triton.selected_experts_triton(*args), want)}, jsonl)
        for gate_up in ((16, 16, 128, 4), (16, 32, 128, 4), (16, 32, 256, 4), (16, 64, 128, 8)):
            for down in ((16, 32, 128, 4), (16, 64, 128, 4), (16, 128, 64, 4)):
                def call(up=gate_up, dn=down):
                    return prompt_experts_triton.tiled_experts_triton(*args, gate_up_tiles=up, down_tiles=dn)
                try:
                    diff = _diff(call(), want)
                    us = graph_time_us(call)
                except Exception as error:  # a tile too large for the registers or shared memory
                    emit({"kernel": "experts sweep", "tokens": tokens, "gate_up": gate_up, "down": down,
                          "error": f"{type(error).__name__}: {error}"[:200]}, jsonl)
                    continue
                emit({"kernel": "experts sweep", "tokens": tokens, "gate_up": gate_up, "down": down,
                      "kernel_us": round(us, 1), "max_diff": diff}, jsonl)


def _conv_taps_pair(tokens: int, heads: int, width: int, rand, device) -> tuple[ConvTaps, ConvTaps]:
    """Two convs of an Inkling conv store (``heads`` x ``width`` channels each, kernel 4, blocks of 4) sharing its
    table: one decode token a row, at position 100 + row, its taps in the store."""
    K = 4
    cols = (100 + tokens) // K + 1  # every row's block table reaches its position
    table = (torch.randperm(tokens * cols) + 1).view(tokens, cols).to(device=device, dtype=torch.int32)
    position = torch.arange(tokens, device=device) + 100
    slots = (table[torch.arange(tokens, device=device), position // K].long() * K + position % K)
    full, prev_len = rand((tokens * cols + 1) * K, heads, 2 * width), position.clone()
    return tuple(ConvTaps(rand(heads * width, K, scale=0.5), full[:, :, i * width: (i + 1) * width], table, K, slots,
                          position, prev_len, 1) for i in range(2))


def _ple_layer(small: bool, device, dtype):
    """transformers' PLE layer of the benchmark config (small shapes under the interpreter), random weights."""
    from bench_generate import qwen4_exp_config
    from transformers.models.qwen4_exp import modeling_qwen4_exp as upstream

    config = qwen4_exp_config(4)
    if small:
        config.hidden_size, config.hc_count, config.ple_embed_dim, config.heads_per_ngram = 40, 3, 16, 2
        config.ngram_vocab_size_base = 31
    torch.manual_seed(0)
    layer = upstream.Qwen4ExpTextPLELayer(config, layer_idx=2, ple_layer_index=0)
    with torch.no_grad():
        for norm in (layer.norm_key, layer.norm_query, layer.norm_conv):
            norm.weight.normal_(0.0, 0.5)
    return layer.to(device=device, dtype=dtype)


def _unfused_recurrent_step(state, query, key, value, b, a, A_log, dt_bias, valid, gate, norm_w, eps, activation):
    """What a GatedDeltaNet decode step runs without ``gdn_step``: the gates' kernel, transformers' recurrent rule
    (flash-linear-attention's kernel where installed), the new state copied into the cache, the norm's kernel."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import torch_recurrent_gated_delta_rule

    beta, g = gated_delta.delta_gates(b[:, None], a[:, None], A_log, dt_bias, valid[:, None])
    core, last = torch_recurrent_gated_delta_rule(query[:, None], key[:, None], value[:, None], g=g, beta=beta,
                                                  initial_state=state, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    state.copy_(last)
    Dv = value.shape[-1]
    return gated_delta_triton.gated_rms_norm_triton(core.reshape(-1, Dv), gate.reshape(-1, Dv), norm_w, eps,
                                                    activation).view(value.shape)


def _written(flush, *flat):
    """The stores after ``flush([(store, rows, values), ...])`` of the triples in ``flat``, run on copies of them."""
    pending = [(flat[i].clone(), flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]
    flush(pending)
    return tuple(store for store, _, _ in pending)


def _written_torch(pending):
    for store, rows, values in pending:
        row_writes.write_slots(store, rows, values)


def _with_state(step, state, *args):
    """``(output, state after)`` of a step that updates ``state`` in place, run on a copy of it."""
    state = state.clone()
    return step(state, *args), state


def _cpu(fn, *args):
    """The torch specification on the CPU (what a fused op replaces), back on the inputs' device."""
    def cpu(a):
        if isinstance(a, tuple):  # a named tuple keeps its type (`experts.SharedExpert`, `sconv.ConvTaps`)
            items = [cpu(t) for t in a]
            return type(a)(*items) if hasattr(a, "_fields") else tuple(items)
        return a.cpu() if isinstance(a, torch.Tensor) else a

    moved = [cpu(a) for a in args]
    result = fn(*moved)
    device = next(a for a in args if isinstance(a, torch.Tensor)).device
    return tuple(r.to(device) for r in result) if isinstance(result, tuple) else result.to(device)


def conv_sweep(device, jsonl) -> None:
    """`conv_prefill_triton`'s (block_t, block_c) at a 16384-token chunk of one row (8192 channels, bf16), each
    checked against the default blocks' output and timed (CUDA events over 20 calls)."""
    g = torch.Generator().manual_seed(0)
    C, L = 8192, 16384
    state = torch.randn(1, C, 3, generator=g).to(device, torch.bfloat16)
    x = torch.randn(1, L, C, generator=g).to(device, torch.bfloat16).transpose(1, 2)
    weight = torch.randn(C, 4, generator=g).to(device, torch.bfloat16)
    want = gated_delta_triton.conv_prefill_triton(state, x, weight, None, False, torch.bfloat16)
    for block_t in (16, 32, 64, 128):
        for block_c in (64, 128, 256):
            def call(bt=block_t, bc=block_c):
                return gated_delta_triton.conv_prefill_triton(state, x, weight, None, False, torch.bfloat16,
                                                              block_t=bt, block_c=bc)
            try:
                same = torch.equal(call(), want)
            except Exception as error:  # a tile too large for the registers or shared memory
                emit({"kernel": "conv_prefill sweep", "block_t": block_t, "block_c": block_c,
                      "error": f"{type(error).__name__}: {error}"[:200]}, jsonl)
                continue
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                call()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1e3 / 20
            emit({"kernel": "conv_prefill sweep", "tokens": L, "block_t": block_t, "block_c": block_c,
                  "kernel_us": round(us, 1), "TBps": round(2 * x.numel() * 2 / us / 1e6, 2), "same": same}, jsonl)


def conv_norm_sweep(device, jsonl) -> None:
    """The `conv_norm` kernels' warps at Inkling's decode shapes (1 and 32 tokens; 16 query and 4 key/value heads of
    128, hidden 2048; bf16), each checked against the default's output and graph-timed (20 calls a graph)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16)

    for tokens in (1, 32):
        k_taps, v_taps = _conv_taps_pair(tokens, 4, 128, rand, device)
        hidden_taps = _conv_taps_pair(tokens, 4, 512, rand, device)[0]
        q, k, v = rand(tokens, 16 * 128), rand(tokens, 4 * 128), rand(tokens, 4 * 128)
        qn, kn, hidden, res, wn = rand(128), rand(128), rand(tokens, 2048), rand(tokens, 2048), rand(2048)
        kernels = {
            "attention_inputs": lambda w: conv_norm_triton.attention_inputs_triton(
                q, k, v, k_taps, v_taps, qn, 1e-6, kn, 1e-6, 128, num_warps=w),
            "conv_add_rms_norm": lambda w: conv_norm_triton.conv_add_rms_norm_triton(
                hidden, hidden_taps, res, wn, 1e-6, num_warps=w),
        }
        for name, call in kernels.items():
            want = call(None) if name == "conv_add_rms_norm" else call(1)
            for warps in (1, 2, 4, 8, 16):
                same = all(torch.equal(a, b) for a, b in zip(call(warps), want))
                emit({"kernel": f"{name} sweep", "tokens": tokens, "num_warps": warps,
                      "kernel_us": round(graph_time_us(lambda w=warps: call(w)), 2), "same": same}, jsonl)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=1, help="tokens of the decode step (rows x step length)")
    parser.add_argument("--small", action="store_true", help="small shapes (the Triton interpreter on the CPU)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--jsonl", default=None)
    parser.add_argument("--conv-sweep", action="store_true", help="only the prompt conv kernel's block sweep")
    parser.add_argument("--conv-norm-sweep", action="store_true", help="only the conv_norm kernels' warps sweep")
    parser.add_argument("--experts-sweep", action="store_true", help="only the tiled experts' tiles sweep")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.experts_sweep:
        experts_sweep(device, args.jsonl)
        return [{"ok": True}]
    if args.conv_sweep:
        conv_sweep(device, args.jsonl)
        return [{"ok": True}]
    if args.conv_norm_sweep:
        conv_norm_sweep(device, args.jsonl)
        return [{"ok": True}]
    dtype = torch.bfloat16
    rows = []
    for name, kernel, diff, tol in compared(device, dtype, args.tokens, args.small):
        row = {"kernel": name, "tokens": args.tokens, "max_diff": diff, "ok": diff <= tol,
               "kernel_us": round(_time(kernel, device, args.repeat), 1)}
        rows.append(row)
        emit(row, args.jsonl)
    print("ALL FUSED KERNELS MATCH" if all(r["ok"] for r in rows) else "FUSED KERNEL MISMATCH")
    return rows


if __name__ == "__main__":
    sys.exit(0 if all(r["ok"] for r in main()) else 1)
