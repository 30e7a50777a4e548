"""GatedDeltaNet's chunked rule with flash-linear-attention's kernel (bf16, CUDA): a step's rows packed into one
batch of sequences (`hf_qsa_cache.ops.gated_delta.chunked_rule`, so the kernel's autotuning sees one shape)
against the same kernel on the rectangle, at the benchmark's head sizes; then a model's prefill both ways.

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_gated_delta.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _kernel_rule():
    """transformers' chunked rule bound as at its import (the conftest routes the module's own name to the torch
    reference for fp32 and CPU tensors, which hides the kernel from `takes_packed_sequences`)."""
    import inspect

    import transformers.models.qwen4_exp.modeling_qwen4_exp as upstream
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    bound = upstream.torch_chunk_gated_delta_rule  # (the conftest's router holds the reference as ``reference``)
    reference = getattr(bound, "__wrapped__", None) or inspect.getclosurevars(bound).nonlocals["reference"]
    return use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(reference)


@pytest.mark.parametrize("rows, length", [(1, 300), (3, 200), (7, 64), (5, 17)])
def test_packed_rows_equal_the_rectangle(rows, length):
    from hf_qsa_cache.ops.gated_delta import chunked_rule, takes_packed_sequences

    rule = _kernel_rule()
    if not takes_packed_sequences(rule):
        pytest.skip("flash-linear-attention is not installed")
    g = torch.Generator(device="cuda").manual_seed(rows * length)
    H, K, V = 16, 128, 128

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    q, k, v = rand(rows, length, H, K), rand(rows, length, H, K), rand(rows, length, H, V)
    decay = -torch.rand(rows, length, H, generator=g, device="cuda")
    beta = torch.rand(rows, length, H, generator=g, device="cuda").to(torch.bfloat16)
    state = torch.randn(rows, H, K, V, generator=g, device="cuda")
    pads = length // 3  # left pads of the last row: zero inputs, no decay, no update
    q[-1, :pads] = k[-1, :pads] = v[-1, :pads] = 0
    decay[-1, :pads] = beta[-1, :pads] = 0
    want, want_state = rule(q, k, v, g=decay, beta=beta, initial_state=state.clone(), output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
    have, have_state = chunked_rule(rule, q, k, v, decay, beta, state.clone())
    scale = want.float().abs().mean().item()
    assert (have.float() - want.float()).abs().max().item() <= 0.02 * scale + 1e-3
    torch.testing.assert_close(have_state, want_state, rtol=2e-2, atol=2e-2)


def test_a_prefill_packed_is_as_close_to_fp32_as_the_rectangle(monkeypatch):
    """Qwen4Exp at the benchmark's widths (4 layers: three GatedDeltaNet, one QSA), a ragged batch prefilled in bf16
    with the rows packed and on the rectangle: each one's mean logit error against the fp32 model (the torch
    reference rule) is about the other's (bf16 runs that differ in rounding drift apart on random weights, and the
    QSA selection turns a rounding into a different key group now and then: judged against fp32, not each other)."""
    import copy

    import transformers.models.qwen4_exp.modeling_qwen4_exp as upstream
    from bench_generate import qwen4_exp_config

    from hf_qsa_cache import QSAPagedCache
    from hf_qsa_cache.ops import gated_delta
    from modeling import Qwen4ExpForCausalLM

    rule = _kernel_rule()
    if not gated_delta.takes_packed_sequences(rule):
        pytest.skip("flash-linear-attention is not installed")
    config = qwen4_exp_config(4)
    torch.manual_seed(0)
    with torch.device("cuda"):
        exact = Qwen4ExpForCausalLM(config).eval()
    low = copy.deepcopy(exact).to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    lengths = [300, 130, 41]
    ids = torch.zeros(3, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(2, 30000, (n,), generator=g)
        mask[row, -n:] = 1
    ids, mask = ids.cuda(), mask.cuda()
    real = mask.bool()

    def logits(model):
        cache = QSAPagedCache(config, 3, 320, block_size=64, device="cuda", dtype=model.dtype)
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits.float()[real]

    want = logits(exact)  # (fp32 tensors: the conftest's router runs the torch reference)
    monkeypatch.setattr(upstream, "torch_chunk_gated_delta_rule", rule)
    packed = (logits(low) - want).abs().mean().item()
    monkeypatch.setattr(gated_delta, "takes_packed_sequences", lambda rule: False)
    rectangle = (logits(low) - want).abs().mean().item()
    print(f"mean |logit - fp32|: packed {packed:.4g}, rectangle {rectangle:.4g}")
    assert packed <= 1.3 * rectangle, (packed, rectangle)


def test_a_graph_owns_the_packed_rows_it_reads():
    """The packed rule recorded in a CUDA graph (a short prefill step's), then eager calls of 70 other shapes (more
    than a memo of 64 shapes, or flash-linear-attention's memo of chunk offsets, four deep, would hold) and the freed
    memory taken by tensors of other values: the replay still equals the eager rule. A graph that recorded bounds
    kept per shape read memory it did not own (in serving: garbage chunk offsets, an illegal memory access)."""
    from hf_qsa_cache.ops.gated_delta import chunked_rule, takes_packed_sequences

    rule = _kernel_rule()
    if not takes_packed_sequences(rule):
        pytest.skip("flash-linear-attention is not installed")
    g = torch.Generator(device="cuda").manual_seed(5)
    H, K, V = 4, 64, 64

    def inputs(rows, length):
        q, k, v = (torch.randn(rows, length, H, D, generator=g, device="cuda").to(torch.bfloat16) for D in (K, K, V))
        decay = -torch.rand(rows, length, H, generator=g, device="cuda")
        beta = torch.rand(rows, length, H, generator=g, device="cuda").to(torch.bfloat16)
        return q, k, v, decay, beta, torch.randn(rows, H, K, V, generator=g, device="cuda")

    static = inputs(2, 128)
    want, want_state = chunked_rule(rule, *static[:5], static[5].clone())
    current, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):  # (a graph's first use of each kernel, as DecodeGraphs warms up)
        chunked_rule(rule, *static[:5], static[5].clone())
    current.wait_stream(side)
    graph, state = torch.cuda.CUDAGraph(), static[5].clone()
    with torch.cuda.graph(graph):
        out, out_state = chunked_rule(rule, *static[:5], state)
    for length in range(33, 103):  # other shapes: a memo of shapes, and flash-linear-attention's, would move on
        chunked_rule(rule, *inputs(1, length))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    scribbles = [torch.full((16,), 1 << 40, dtype=torch.long, device="cuda") for _ in range(20000)]
    state.copy_(static[5])
    graph.replay()
    torch.cuda.synchronize()
    del scribbles
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out_state, want_state, rtol=2e-2, atol=2e-2)
