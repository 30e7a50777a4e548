"""Every fusion on at once (`HF_QSA_FUSED=all`, and the selected-experts implementation): each row of
a ragged batch still gives upstream's greedy tokens on that row alone (fp32, CPU: the fusions' written-out
torch arithmetic), through generate() with a chunked prefill and through the step a CUDA graph records."""

from __future__ import annotations

import pytest
import torch
import helpers.inkling as inkling
from helpers.qwen4 import left_pad, make_pair, random_prompts

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.cuda_graphs import graphs_of
from hf_qsa_cache.fusions import FUSIONS, fused
from hf_qsa_cache.ops import experts, gated_delta, hyper_connection, norm_rope, rms_norm


@pytest.fixture
def all_fused():
    with fused(("all",)):
        yield


def _family(name):
    if name == "qwen4_exp":
        upstream, ours = make_pair(seed=11)
        rows = random_prompts([26, 8, 19], seed=12)
        return upstream, ours, rows, left_pad(rows)
    upstream, ours = inkling.make_pair(inkling.make_config(), seed=13)
    rows = [r.tolist() for r in inkling.make_prompts([14, 5, 22], seed=14)]
    return upstream, ours, rows, inkling.left_pad([torch.tensor(r) for r in rows])


@pytest.mark.parametrize("name", ["qwen4_exp", "inkling"])
def test_all_fusions_give_upstreams_tokens_per_row(all_fused, name):
    upstream, ours, rows, (ids, mask) = _family(name)
    ours.set_experts_implementation(experts.SELECTED_EXPERTS)
    ours.prefill_chunk_tokens = 9  # prefill in chunks of 3 tokens per row: multi-token steps on held rows
    n = 6
    with torch.no_grad():
        out = ours.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                            output_logits=True, return_dict_in_generate=True)
        for i, row in enumerate(rows):
            ref = upstream.generate(torch.tensor([row]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                                    output_logits=True, return_dict_in_generate=True)
            assert out.sequences[i, -n:].tolist() == ref.sequences[0, -n:].tolist(), f"row {i}"
            torch.testing.assert_close(torch.stack([s[i] for s in out.logits]), torch.stack([s[0] for s in ref.logits]),
                                       atol=1e-4, rtol=0)

    # The recorded step (static buffers, reach-sized shapes) with the fusions equals the forward with them.
    eager = QSAPagedCache(ours.config, 4, 64, block_size=4)
    static = QSAPagedCache(ours.config, 4, 64, block_size=4)
    runner = graphs_of(ours, static, "cpu", record=False)
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask, past_key_values=eager).logits[:, -1:]
        ours(ids, attention_mask=mask, past_key_values=static)
        for step in range(4):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            logits = ours(nxt, attention_mask=mask, past_key_values=eager).logits
            torch.testing.assert_close(runner.step(nxt, None, mask), logits, atol=5e-5, rtol=0)


def test_modules_with_hooks_run_their_own_forward(all_fused, monkeypatch):
    """A hooked module (accelerate's offloading wrapper sets ``_hf_hook``; a user's forward hook) keeps its own
    forward: the fused ops would read weights that only its forward loads, or skip what the hook expects."""
    from helpers.qwen4 import tiny_config
    from transformers.models.inkling.modeling_inkling import InklingRMSNorm
    from transformers.models.qwen4_exp import modeling_qwen4_exp as upstream

    config = tiny_config()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 16, generator=g)
    cases = [
        (InklingRMSNorm(16), lambda m: rms_norm.add_rms_norm(m, x), rms_norm, "add_rms_norm_torch"),
        (upstream.Qwen4ExpTextRMSNorm(16), lambda m: norm_rope.norm_rope(m, x, x[:, 0, :8], x[:, 1, :8]), norm_rope,
         "norm_rope_written_out"),
        (upstream.Qwen4ExpTextRMSNormGated(16), lambda m: gated_delta.gated_rms_norm(m, x[0], x[1]), gated_delta,
         "gated_rms_norm_torch"),
        (upstream.Qwen4ExpTextGatedResidual(config),
         lambda m: hyper_connection.gated_residual(m, torch.randn(2, config.hc_count * config.hidden_size, generator=g)),
         hyper_connection, "hc_norm"),
    ]
    for module, run, ops, fused_function in cases:
        calls = []
        real = getattr(ops, fused_function)
        monkeypatch.setattr(ops, fused_function, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
        with torch.no_grad():
            run(module)
            assert calls, f"{type(module).__name__}: the fused path did not run without hooks"
            calls.clear()
            module._hf_hook = object()  # as accelerate's add_hook_to_module leaves it
            run(module)
            del module._hf_hook
            handle = module.register_forward_pre_hook(lambda *a: None)
            run(module)
            handle.remove()
        assert calls == [], f"{type(module).__name__}: the fused path ran on a hooked module"


def test_fused_switches_the_registry_and_restores_it():
    """`fused` sets the named switches (or all) for a block and restores them after; it refuses unknown names, as
    `enabled` does."""
    from hf_qsa_cache import fusions

    before = dict(fusions.STATE)
    with fused(("all",)):
        assert all(fusions.enabled(n) for n in FUSIONS) and fusions.active() == "all"
        with fused(("hc", "norm"), on=False):
            assert not fusions.enabled("hc") and not fusions.enabled("norm") and fusions.enabled("gdn")
            assert "hc" not in fusions.active().split(",")
        assert all(fusions.enabled(n) for n in FUSIONS)
    assert fusions.STATE == before
    assert set(FUSIONS) == {"hc", "hc_proj", "gdn", "norm", "experts", "router", "qsa", "qsa_topk", "shared_expert",
                            "inkling_router", "prompt_experts", "projections", "ple", "conv_norm", "tiled_experts",
                            "rel_bias", "pdl", "gdn_step", "qsa_writes", "qsa_gate", "token_log"}
    with pytest.raises(ValueError, match="unknown fusion"):
        with fused(("nope",)):
            pass
    with pytest.raises(KeyError):
        fusions.enabled("nope")
    with fused(("all",), on=False):
        assert fusions.active() == "none"


def test_an_unknown_name_in_the_environment_is_refused_at_import():
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_QSA_FUSED="hc,nrom")
    proc = subprocess.run([sys.executable, "-c", "import hf_qsa_cache"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown fusion(s) ['nrom']" in proc.stderr
    assert "known: hc, hc_proj, gdn, gdn_step" in proc.stderr


DEFAULT_SET = {"hc", "hc_proj", "gdn", "gdn_step", "norm", "experts", "router", "qsa", "qsa_topk", "shared_expert",
               "inkling_router", "prompt_experts", "projections", "ple", "conv_norm", "tiled_experts", "pdl",
               "qsa_writes", "qsa_gate", "rel_bias", "token_log"}


def test_a_fusion_off_by_default_is_on_only_when_named():
    from hf_qsa_cache.fusions import requested

    table = {**FUSIONS, "inkling_router": False}
    assert requested(None, table) == set(FUSIONS) - {"inkling_router"}
    assert requested("all", table) == set(FUSIONS)
    assert requested("inkling_router,hc", table) == {"inkling_router", "hc"}
    assert requested("default", table) == set(FUSIONS) - {"inkling_router"}
    assert requested(" default , inkling_router", table) == set(FUSIONS)


SETTINGS = [(None, DEFAULT_SET), ("all", DEFAULT_SET), ("none", set()), ("", set()),
            ("default,rel_bias", DEFAULT_SET), ("gdn,router", {"gdn", "router"})]


@pytest.mark.parametrize("setting, expected", SETTINGS)
def test_each_setting_turns_on_its_fusions(setting, expected):
    from hf_qsa_cache import fusions

    assert fusions.requested(setting) == expected


@pytest.mark.parametrize("setting, expected", [SETTINGS[0], SETTINGS[-1]])
def test_the_environment_sets_the_switches_at_import(setting, expected):
    """In a fresh process (the registry parses HF_QSA_FUSED when imported): unset, the default set; a comma list,
    those only."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HF_QSA_FUSED"}
    if setting is not None:
        env["HF_QSA_FUSED"] = setting
    script = ("from hf_qsa_cache import fusions\n"
              "print(sorted(n for n in fusions.FUSIONS if fusions.enabled(n)))")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == str(sorted(expected))
