"""bf16 accuracy of both families against upstream transformers, on the CPU.

Logits. The same random weights run as upstream fp32 (the reference), upstream bf16 and ours bf16;
the same tokens are teacher-forced (ours: a left-padded ragged prefill, then one decode step per
token, reading the paged stores). Our mean |logit - reference| must not exceed 1.3x upstream bf16's
own, over the prompt positions and over the teacher-forced steps. The configs make every mechanism
act: sliding windows and the relative extent are shorter than the prompts, log scaling is on, QSA
selects a subset of the groups.

MoE routing. The routers pick their top-k experts from scores that bf16 rounding moves: a token
whose choice flips (in upstream bf16 just as in ours, at the same rate) takes a logit error tens of
times the others', so over a few teacher-forced tokens the ratio is a count of flips more than a
measure of rounding. Here every expert is routed (``num_experts_per_tok = n_experts``): the MoE code
runs with no discrete choice left.

Rounding points. A single extra bf16 rounding moves the logit error by a few percent only (bf16 is
rounded after every upstream op already), below what the logit ratio can show. So the attention
softmax of both families is also checked directly: with bf16 inputs it must equal the softmax of
the same values rounded where upstream rounds them and computed in fp32 everywhere else; the short
conv must round once, at its output (upstream's conv runs in fp32: its weights stay fp32 on a bf16 load).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.inkling.modeling_inkling import InklingRelativeLogits, repeat_kv

import helpers.qwen4 as q
import helpers.inkling as ink
from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.ops import qsa
from hf_qsa_cache.ops.inkling_attention import _rel_softmax, paged_rel_attention_torch
from hf_qsa_cache.ops.sconv import short_conv_torch
from test_inkling_sconv import _case as sconv_case, _dense_reference
from test_inkling_attention_kernel import make_case
from test_qsa_kernels import attention_case

LIMIT = 1.3
FORCED = 12
PROMPT_LENS = [60, 41, 25]
SEEDS = range(4)


def _errors(upstream, ours, prompts: list[list[int]], forced: torch.Tensor, block_size: int = 4):
    """Summed per-row mean |logit - upstream fp32| of (upstream bf16, ours bf16) at the prompt
    positions and at the teacher-forced steps (the prompt's last position, then one per forced token)."""
    up16 = copy.deepcopy(upstream).to(torch.bfloat16)
    ours16 = copy.deepcopy(ours).to(torch.bfloat16)
    ids, mask = q.left_pad(prompts)
    width = ids.shape[1]
    sums = {"prompt": torch.zeros(2), "steps": torch.zeros(2)}
    with torch.no_grad():
        cache = QSAPagedCache(ours16.config, len(prompts), width + FORCED, block_size=block_size)
        prefill = ours16(ids, attention_mask=mask, past_key_values=cache).logits.float()
        steps = []
        for t in range(FORCED - 1):
            tok = forced[:, t:t + 1]
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            steps.append(ours16(tok, attention_mask=mask, past_key_values=cache).logits[:, -1].float())
        steps = torch.stack(steps, dim=1)
        for i, p in enumerate(prompts):
            n = len(p)
            seq = torch.tensor([list(p) + forced[i, :FORCED - 1].tolist()])
            ref = upstream(seq).logits[0].float()
            err_up = (up16(seq).logits[0].float() - ref).abs().mean(-1)
            err_ours = (torch.cat([prefill[i, width - n:], steps[i]]) - ref).abs().mean(-1)
            sums["prompt"] += torch.stack([err_up[:n].mean(), err_ours[:n].mean()])
            sums["steps"] += torch.stack([err_up[n - 1:].mean(), err_ours[n - 1:].mean()])
    return sums


def _check_ratio(name: str, sums: dict):
    for part, (up, ours) in sums.items():
        ratio = float(ours / up)
        assert ratio <= LIMIT, (f"{name} bf16, {part}: mean |logit - upstream fp32| ours {float(ours):.3e}, "
                                f"upstream bf16 {float(up):.3e}: ratio {ratio:.2f} > {LIMIT}")


def test_inkling_bf16_logits_within_upstream_margin():
    config = ink.make_config(num_experts_per_tok=4)  # all 4 routed experts: no routing flips
    assert config.sliding_window_size < min(PROMPT_LENS) and config.rel_extent < min(PROMPT_LENS)
    total = {"prompt": torch.zeros(2), "steps": torch.zeros(2)}
    for seed in SEEDS:
        upstream, ours = ink.make_pair(config, seed=seed)
        with torch.no_grad():  # unit-RMS q and k scaled by 3: a sharp softmax, where rounding matters most
            for model in (upstream, ours):
                for name, p in model.named_parameters():
                    if "q_norm" in name or "k_norm" in name:
                        p.fill_(3.0)
        g = torch.Generator().manual_seed(100 + seed)
        prompts = [torch.randint(2, config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
        forced = torch.randint(2, config.vocab_size, (len(PROMPT_LENS), FORCED), generator=g)
        for part, s in _errors(upstream, ours, prompts, forced).items():
            total[part] += s
    _check_ratio("inkling", total)


def test_qwen4_exp_bf16_logits_within_upstream_margin():
    config = q.tiny_config(num_experts_per_tok=4)  # all 4 experts: no routing flips
    ratio = config.indexer_compress_ratio
    assert min(PROMPT_LENS) // ratio > config.indexer_budget // ratio  # QSA selects a subset of the groups
    total = {"prompt": torch.zeros(2), "steps": torch.zeros(2)}
    for seed in SEEDS:
        upstream, ours = q.make_pair(config, seed=seed)
        prompts = q.random_prompts(PROMPT_LENS, vocab=config.vocab_size, seed=100 + seed)
        forced = torch.randint(2, config.vocab_size, (len(PROMPT_LENS), FORCED),
                               generator=torch.Generator().manual_seed(200 + seed))
        for part, s in _errors(upstream, ours, prompts, forced).items():
            total[part] += s
    _check_ratio("qwen4_exp", total)


# ----------------------------------------------------------------------------- rounding points


def _rounded_once(have: torch.Tensor, exact: torch.Tensor) -> bool:
    """``have`` (bf16) is ``exact`` (fp32) rounded once: within half a bf16 ulp of it, plus a little
    for fp32 summation order. A second rounding, or a bf16 accumulator, leaves that bound."""
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    return bool(((have.float() - exact).abs() <= ulp / 2 + exact.abs() * 1e-6).all())


@pytest.mark.parametrize("window,extent,log_scaling", [(None, 12, (4.0, 0.5)), (8, 8, None), (None, 64, None)])
def test_inkling_attention_rounds_where_upstream_does(window, extent, log_scaling):
    """The torch op on bf16 inputs against upstream's own steps: ``r @ P`` and its gather in bf16
    (`InklingRelativeLogits`), tau applied in fp32 and rounded back into q and the bias (as
    `InklingAttention` does), then scores, bias sum and softmax in fp32 (sdpa's accumulator). The
    softmax must match to fp32 summation order; the output is the fp32 product with the values,
    rounded to bf16 once. (The Triton kernel rounds the probabilities to bf16 for its tensor-core
    product, as sdpa's CUDA kernels do; `test_inkling_attention_kernel` holds it to this op.)"""
    bf16 = torch.bfloat16
    L, Hq, Hkv = 40, 4, 2
    args, _ = make_case(11, [(0, L)], L=L, heads=Hq, kv_heads=Hkv, head_dim=16, extent=extent, window=window,
                        dtype=bf16, log_scaling=log_scaling)
    args["q"] = args["q"] * 3  # unit-RMS q in the model; sharper here, where a rounded logit shows most
    qs, ks, vs, r, proj, scaling = (args[n] for n in ("q", "k", "v", "r", "proj", "scaling"))
    position = args["position"]
    assert torch.equal(position, torch.arange(L))

    (c0, c1, k0, probs, _, _), = list(_rel_softmax(
        qs, ks, r, proj, ks[:, :0], torch.zeros(1, 0, dtype=torch.long), position, scaling, window, log_scaling))
    assert (c0, c1, k0) == (0, L, 0)
    ours = probs.reshape(1, L, Hq, L).transpose(1, 2)  # [B, H, Lq, S]

    rel = InklingRelativeLogits(r.shape[-1], extent).to(bf16)
    rel.proj.data.copy_(proj)
    bias = rel(r, position, position)  # [B, H, Lq, S], bf16
    query = qs.transpose(1, 2)
    if log_scaling is not None:
        n_floor, alpha = log_scaling  # upstream's lines
        tau = 1.0 + alpha * torch.log(((position + 1).float() / n_floor).clamp(min=1.0))
        tau = tau.view(1, 1, -1, 1)
        query = (query.float() * tau).to(bf16)
        bias = (bias.float() * tau).to(bf16)
    keys = repeat_kv(ks.transpose(1, 2), Hq // Hkv)
    scores = torch.matmul(query.float(), keys.float().transpose(2, 3)) * scaling + bias.float()
    dist = position[:, None] - position[None, :]
    visible = (dist >= 0) & ((dist < window) if window is not None else True)
    want = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    torch.testing.assert_close(ours, want, atol=2e-6, rtol=0)

    out = paged_rel_attention_torch(**args).view(1, L, Hq, -1).transpose(1, 2)
    values = repeat_kv(vs.transpose(1, 2), Hq // Hkv).float()
    assert _rounded_once(out, torch.matmul(want, values))


def test_qsa_softmax_keeps_logits_fp32():
    """`_selected_softmax` on bf16 query and keys equals it on their fp32 copies: no logit is rounded."""
    case = attention_case(5, group=2, num_kv=2, head_dim=16, dtype=torch.bfloat16)
    query, keys, values, table, token_row, positions, block_size, _ = case
    query = query * 4  # sharp: a rounded logit would move the probabilities by ~1e-2
    scaling = 0.25

    def probs(qry, k):
        return torch.cat([p for _, _, p, _ in qsa._selected_softmax(qry, k, table, token_row, positions, block_size,
                                                                     scaling)])

    torch.testing.assert_close(probs(query, keys), probs(query.float(), keys.float()), atol=1e-6, rtol=0)


def test_short_conv_rounds_once():
    """`short_conv_torch` on bf16 inputs, taps from the store and from this forward: the fp32 conv plus
    residual of the same values, rounded to bf16 once."""
    rows = [(0, 5), (6, 3), (2, 1), (9, 4)]
    L = 6
    args, history, store_full = sconv_case(4, rows, L=L, H=2, width=8)
    width = args["store"].shape[2]
    store = store_full.to(torch.bfloat16)[:, :, 1: 1 + width]
    store.copy_(args["store"])
    args = {**args, "x": args["x"].to(torch.bfloat16), "weight": args["weight"].to(torch.bfloat16), "store": store}
    y = short_conv_torch(**args).view(len(rows), L, -1)
    for b, (p, c) in enumerate(rows):
        exact = _dense_reference(history[b].to(torch.bfloat16).float(), args["weight"].float())[p:]
        assert _rounded_once(y[b, L - c:], exact), f"row {b}"
