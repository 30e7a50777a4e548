"""`benchmarks/bench_generate.py`'s bytes floor counts the rows a decode step looks up in the token and n-gram
embedding tables, not the tables: the rows per token it assumes are the rows a real decode step looks up."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from helpers.qwen4 import make_pair, random_prompts, tiny_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import bench_generate  # noqa: E402
import floors  # noqa: E402

from hf_qsa_cache import QSAPagedCache  # noqa: E402


def rows_looked_up_per_token(model, batch: int) -> dict[str, int]:
    """Distinct rows each embedding table gives per token in one decode step of ``batch`` rows."""
    seen = {}
    hooks = [
        module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(f"{name}.weight", args[0]))
        for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)
    ]
    prompts = random_prompts([9] * batch, seed=4)
    ids = torch.tensor(prompts)
    cache = QSAPagedCache(model.config, max_batch_size=batch, max_cache_len=16)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)  # the prompt
        seen.clear()
        model(ids[:, -1:], past_key_values=cache, use_cache=True)  # one decode step
    for hook in hooks:
        hook.remove()
    per_token = {}
    for name, index in seen.items():
        rows = index.reshape(batch, -1)  # one token a row in a decode step
        per_token[name] = max(len(set(r.tolist())) for r in rows)
    return per_token


def test_lookup_rows_are_the_rows_a_decode_step_reads():
    _, model = make_pair(tiny_config(ple_layer_ids=[1]))
    declared = bench_generate.lookup_rows_per_token(model)
    assert rows_looked_up_per_token(model, batch=2) == declared
    assert len(declared) == 2 and declared["model.embed_tokens.weight"] == 1  # the token and n-gram tables


@pytest.mark.parametrize("batch", [1, 3])
def test_floor_counts_rows_read_not_whole_tables(batch):
    _, model = make_pair(tiny_config(ple_layer_ids=[1]))
    config = model.config
    params = dict(model.named_parameters())
    table_bytes, rows_bytes = 0, 0
    for name, per_token in rows_looked_up_per_token(model, batch).items():
        table = params[name]
        row = table[0].numel() * table.element_size()
        table_bytes += table.shape[0] * row
        rows_bytes += min(table.shape[0], batch * per_token) * row
    whole = bench_generate.decode_bytes(model, config, batch, 64, whole_tables=True)
    now = bench_generate.decode_bytes(model, config, batch, 64)
    assert whole - now == table_bytes - rows_bytes > 0


def test_a_table_the_lm_head_shares_is_read_whole():
    _, model = make_pair(tiny_config(ple_layer_ids=[1]))
    model.lm_head.weight = model.model.embed_tokens.weight
    assert "model.embed_tokens.weight" not in bench_generate.lookup_rows_per_token(model)


def test_recorded_floors_are_rescaled_by_the_bytes_counted(monkeypatch):
    counted = {True: 300.0, False: 200.0}
    monkeypatch.setattr(floors.bench_generate, "decode_bytes",
                        lambda model, config, batch, length, whole_tables=False: counted[whole_tables])
    models = {("qwen4_exp", 8): (None, None)}
    old = {"model": "qwen4_exp", "layers": 8, "batch": 1, "prompt_len": 16, "floor_ms": 0.6}
    assert floors.corrected(old, models)["floor_ms"] == pytest.approx(0.4)
    new = dict(old, floor_lookup_rows=True)
    assert floors.corrected(new, models)["floor_ms"] == 0.6  # written with the rows already


def test_every_recorded_floor_recomputes_below_itself_by_the_tables():
    """On the results file itself: each line's floor recomputed is the recorded one less the tables' bytes (the
    token table for both families, the n-gram table too for Qwen4Exp), so it drops by about the same time on
    every line of a family: a per-line rescaling that went wrong would show as a spread."""
    import json

    with open(bench_generate.RESULTS) as f:
        lines = [json.loads(text) for text in f if text.strip()]
    lines = [x for x in lines if x.get("impl") == "paged" and x.get("floor_ms") and x.get("graphs")
             and not x.get("floor_lookup_rows")]  # (lines written since count the rows themselves)
    assert len(lines) > 50
    models, dropped = {}, {}
    for line in lines:
        fixed = floors.corrected(line, models)
        assert 0 < fixed["floor_ms"] < fixed["floor_ms_recorded"]
        dropped.setdefault(line["model"], []).append(fixed["floor_ms_recorded"] - fixed["floor_ms"])
    # 131 MB (+ 410 MB for Qwen4Exp) at the runs' 4.2-4.3 TB/s: about 0.031 ms and 0.127 ms.
    assert all(0.028 < d < 0.034 for d in dropped["inkling"]), dropped["inkling"]
    assert all(0.118 < d < 0.135 for d in dropped["qwen4_exp"]), dropped["qwen4_exp"]
