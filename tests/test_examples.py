"""examples/generate_multi_gpu.py data-parallel on the CPU: prompts really split over processes (gloo)
and reassembled in prompt order, with the same tokens as one process generating them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
SCRIPT = os.path.join(EXAMPLES, "generate_multi_gpu.py")
PROMPTS, NEW = 5, 4  # 5 prompts over 2 ranks: uneven shares, and a wrong reassembly changes the order


def _run(launcher: list[str], out) -> dict:
    # No GPU (so gloo), one thread per process, and this checkout's packages ahead of any installed copy.
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = launcher + [SCRIPT, "data-parallel", "--prompts", str(PROMPTS), "--new-tokens", str(NEW), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens identical to a one-process run: True" in proc.stdout, proc.stdout
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


def test_continuous_batching_example_runs_and_matches_generate():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "continuous_batching.py"), "--requests", "6",
                           "--rows", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 requests, 192 new tokens" in proc.stdout, proc.stdout
    assert "requests equal generate() on their prompt alone: True" in proc.stdout, proc.stdout


def test_tensor_parallel_example_on_two_cpu_processes():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, "tp+ep",
           "--model", "inkling", "--prompts", "3", "--new-tokens", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tokens identical to a one-process run: True" in proc.stdout, proc.stdout
    assert "experts' gate/up weights on this rank: (" in proc.stdout, proc.stdout


def test_multimodal_example_runs_and_rows_equal_alone():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "generate_multimodal.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("qwen4_exp", "inkling"):
        assert f"{name}: rows equal generate() on each row alone: True" in proc.stdout, proc.stdout
