"""The examples run and check their own tokens: each prints an OK verdict, and exits with status 1 when its
reference disagrees (a reference with other weights, forced here). examples/generate_multi_gpu.py data-parallel
on the CPU: prompts really split over processes (gloo) and reassembled in prompt order, with the same tokens as
one process generating them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
SCRIPT = os.path.join(EXAMPLES, "generate_multi_gpu.py")
PROMPTS, NEW = 5, 4  # 5 prompts over 2 ranks: uneven shares, and a wrong reassembly changes the order


def _env() -> dict:
    # No GPU (so gloo), one thread per process, and this checkout's packages ahead of any installed copy.
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


def _example(cmd: list[str]) -> str:
    """Run an example command (a script and its arguments, after a launcher); its stdout, once it exited 0."""
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _run(launcher: list[str], out) -> dict:
    stdout = _example(launcher + [SCRIPT, "data-parallel", "--prompts", str(PROMPTS), "--new-tokens", str(NEW),
                                  "--out", str(out)])
    world = 2 if "--nproc_per_node" in launcher else 1
    assert (f"OK: data parallel over {world} process(es): all {PROMPTS} rows ({PROMPTS * NEW} new tokens) equal to "
            "one process generating every prompt in one batch") in stdout, stdout
    return json.loads(out.read_text())


def _one_process_tokens(monkeypatch) -> list[list[int]]:
    """All prompts generated in this process, in one batch, without the example's gather code."""
    monkeypatch.syspath_prepend(EXAMPLES)
    import generate_multi_gpu as example

    model = example.build("qwen4_exp")
    return example.generate(model, example.prompts(PROMPTS, model.config.vocab_size), NEW, "cpu")


def test_data_parallel_two_cpu_processes_match_one_process(tmp_path, monkeypatch):
    result = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
                  tmp_path / "tokens.json")
    assert result["backend"] == "gloo" and result["world_size"] == 2
    assert result["ranks"] == [[0, 2, 4], [1, 3]]
    assert result["tokens"] == _one_process_tokens(monkeypatch)


def test_data_parallel_runs_as_one_plain_process(tmp_path, monkeypatch):
    result = _run([sys.executable], tmp_path / "tokens.json")
    assert result["world_size"] == 1 and result["ranks"] == [list(range(PROMPTS))]
    assert result["tokens"] == _one_process_tokens(monkeypatch)


def test_qwen4_exp_example_equals_transformers():
    """The README's first command, as it is: every row equals transformers' own class on that row alone."""
    stdout = _example([sys.executable, os.path.join(EXAMPLES, "generate_qwen4_exp.py")])
    assert ("OK: qwen4_exp: all 3 rows (72 new tokens) equal to transformers' Qwen4ExpForCausalLM (same weights, "
            "fp32, CPU) on each row alone, unpadded") in stdout, stdout


def test_inkling_example_equals_transformers():
    stdout = _example([sys.executable, os.path.join(EXAMPLES, "generate_inkling.py"), "--new-tokens", "12"])
    assert ("OK: inkling: all 4 rows (48 new tokens) equal to transformers' InklingForCausalLM (same weights, fp32, "
            "CPU) on each row alone, unpadded") in stdout, stdout


def test_continuous_batching_example_runs_and_matches_transformers():
    stdout = _example([sys.executable, os.path.join(EXAMPLES, "continuous_batching.py"), "--requests", "6",
                       "--rows", "3"])
    assert "6 requests, 192 new tokens" in stdout, stdout
    assert ("OK: continuous batching: all 6 rows (192 new tokens) equal to transformers' Qwen4ExpForCausalLM "
            "(same weights, fp32, CPU) on each prompt alone" in stdout), stdout


def test_tensor_parallel_example_on_two_cpu_processes():
    stdout = _example([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       SCRIPT, "tp+ep", "--model", "inkling", "--prompts", "3", "--new-tokens", "4"])
    assert ("OK: inkling tp+ep over 2 process(es): all 3 rows (12 new tokens) equal to the same weights in one "
            "process") in stdout, stdout
    assert "experts' gate/up weights on this rank: (" in stdout, stdout


def test_multimodal_example_equals_transformers():
    stdout = _example([sys.executable, os.path.join(EXAMPLES, "generate_multimodal.py")])
    assert ("OK: qwen4_exp: all 3 rows (36 new tokens) equal to transformers' Qwen4ExpForConditionalGeneration "
            "(same weights, fp32, CPU) on each row alone, unpadded") in stdout, stdout
    assert ("OK: inkling: all 2 rows (24 new tokens) equal to transformers' InklingForConditionalGeneration "
            "(same weights, fp32, CPU) on each row alone, unpadded") in stdout, stdout


def test_split_example_skips_without_two_gpus():
    stdout = _example([sys.executable, SCRIPT, "split"])
    assert "SKIP: split needs at least 2 CUDA devices to split the model over, found 0" in stdout, stdout


# A mismatch exits 1: each example run in this process, its reference given other weights (the output projection
# negated, so greedy picks other tokens from the first one on).
def _negate_output(model) -> None:
    with torch.no_grad():
        model.get_output_embeddings().weight.neg_()


def _twin_with_other_weights(example, monkeypatch) -> None:
    make = example.transformers_twin

    def other(model, cls):
        twin = make(model, cls)
        _negate_output(twin)
        return twin

    monkeypatch.setattr(example, "transformers_twin", other)


def _exits_with_mismatch(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 1
    out = capsys.readouterr()
    assert "OK:" not in out.out, out.out
    assert "MISMATCH:" in out.err, out.err
    return out.err


@pytest.fixture
def examples_path(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name, argv", [("generate_qwen4_exp", ["--new-tokens", "3"]),
                                        ("generate_inkling", ["--new-tokens", "3"]),
                                        ("generate_multimodal", ["--model", "inkling"])])
def test_example_exits_1_when_transformers_disagrees(name, argv, examples_path, monkeypatch, capsys):
    import importlib

    example = importlib.import_module(name)
    _twin_with_other_weights(example, monkeypatch)
    err = _exits_with_mismatch(example.main, ["--device", "cpu", *argv], capsys)
    assert "row 0 differs from transformers'" in err and "at new token 0" in err, err


def test_continuous_batching_exits_1_when_a_request_differs(examples_path, monkeypatch, capsys):
    import continuous_batching as example

    alone = example.alone

    def other(model, prompts, new_tokens):
        _negate_output(model)
        return alone(model, prompts, new_tokens)

    monkeypatch.setattr(example, "alone", other)
    err = _exits_with_mismatch(example.main, ["--device", "cpu", "--requests", "2", "--rows", "2"], capsys)
    assert ("continuous batching: 2 of 2 rows differ from transformers' Qwen4ExpForCausalLM (same weights, fp32, "
            "CPU) on each prompt alone" in err), err


def test_data_parallel_exits_1_when_the_one_process_run_differs(examples_path, monkeypatch, capsys):
    """The reference run (the second `generate` call of a plain one-process run) by other weights."""
    import generate_multi_gpu as example

    generate, calls = example.generate, []

    def other(model, batch, new_tokens, device):
        calls.append(len(batch))
        if len(calls) == 2:
            _negate_output(model)
        return generate(model, batch, new_tokens, device)

    monkeypatch.setattr(example, "generate", other)
    err = _exits_with_mismatch(example.main, ["data-parallel", "--prompts", "2", "--new-tokens", "2"], capsys)
    assert calls == [2, 2] and "data parallel over 1 process(es): 2 of 2 rows differ" in err, err
