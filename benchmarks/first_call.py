"""Time of the first `generate()` in a new process: what every new process pays before its first token.

    python benchmarks/first_call.py --model qwen4_exp --layers 8 --batch 4 --prompt 2048
    python benchmarks/first_call.py --model inkling --device cpu --tiny --batch 2 --prompt 20   # logic check (CI)

Runs the same child process ``--processes`` times (default 2), one after the other. Each child builds the
model (bf16 on CUDA, random weights), then times its first `generate()` call and a second identical one.
The first child also fills the on-disk kernel caches (Triton's compiled kernels, and their autotuning
where a kernel caches it); later children show what a user pays once the machine has compiled them: the
figure the issue's first-call target is about. The gap between a child's first and second call is
kernel compilation still done per process, CUDA-graph capture (one per batch bucket and reach), and
lazily allocated state. Prints one JSON line per child and appends them to ``--jsonl`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(args) -> dict:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    start = time.perf_counter()
    import torch

    from bench_speculative import build

    from hf_qsa_cache import fusions

    imported = time.perf_counter() - start
    on_gpu = torch.device(args.device).type == "cuda"
    if on_gpu and not args.tiny:
        torch.set_default_dtype(torch.bfloat16)
    model, layers = build(args.model, args.layers, args.device, args.tiny)
    torch.set_default_dtype(torch.float32)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(2, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    calls = []
    for _ in range(2):
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
        if on_gpu:
            torch.cuda.synchronize()
        calls.append(time.perf_counter() - t)
    return {"model": args.model, "layers": layers, "batch": args.batch, "prompt_len": args.prompt,
            "new_tokens": args.new_tokens, "device": args.device, "fused": fusions.active(),
            "import_s": round(imported, 3), "first_call_s": round(calls[0], 3), "second_call_s": round(calls[1], 3)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the test suite's small fp32 configs")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--jsonl", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return []
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_generate import emit

    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--child"]
    rows = []
    for i in range(args.processes):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *forwarded, "--child"], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"child {i} failed:\n{proc.stdout}\n{proc.stderr}")
        row = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process": i}
        rows.append(row)
        emit(row, args.jsonl)
    return rows


if __name__ == "__main__":
    main()
