"""The fused decode kernels (`hf_qsa_cache.fusions`) at the benchmark shapes, on and off in one process.

    python benchmarks/check_fusions.py --model qwen4_exp --layers 4 --batch 4 --prompt 2048
    python benchmarks/check_fusions.py --model inkling --layers 6 --batch 4 --prompt 2048
    python benchmarks/check_fusions.py --model inkling --device cpu --tiny   # logic check (CI)

The same random model in bf16 runs a prefill and ``--steps`` teacher-forced decode steps (CUDA graphs on),
once with every fusion off and once with all on; an fp32 copy with the fusions off is the reference. It
prints the mean |logit - fp32| of both bf16 runs (the fused one may not be further from fp32 than 1.1x the
unfused one: the fusions round less often, never more), their decode ms/step, and one JSON line.
``--fusions gdn,norm`` turns on only those. With top-k routing a token whose router picks other experts
in bf16 than in fp32 has an error tens of times the others', so a handful of such flips can decide the
ratio either way; ``--all-experts`` routes every token to every expert, which leaves rounding alone.
On the CPU (``--tiny``: the test suite's fp32 models) both runs are fp32 and only the logic is checked.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generate import emit  # noqa: E402
from bench_speculative import build  # noqa: E402

from hf_qsa_cache import QSAPagedCache  # noqa: E402
from hf_qsa_cache.fusions import fused  # noqa: E402


def forced_logits(model, ids: torch.Tensor, forced: torch.Tensor, fusions_on: bool,
                  names: tuple[str, ...] = ("all",)) -> tuple[torch.Tensor, float]:
    """Logits ``[steps, B, vocab]`` (fp32) of ``forced`` fed one column a step after ``ids``, and the median
    step time in ms."""
    on_gpu = ids.is_cuda
    config = model.config.get_text_config(decoder=True)
    with fused(names, on=fusions_on), torch.no_grad():
        cache = QSAPagedCache(config, ids.shape[0], ids.shape[1] + forced.shape[1] + 1)
        mask = torch.ones_like(ids)
        model(ids, attention_mask=mask, past_key_values=cache)
        logits, times = [], []
        for step in range(forced.shape[1]):
            token = forced[:, step: step + 1]
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = model(token, attention_mask=mask, past_key_values=cache).logits[:, -1]
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            logits.append(out.float())
    return torch.stack(logits), statistics.median(times[2:] or times) * 1e3  # the first steps capture graphs


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the test suite's small fp32 configs")
    parser.add_argument("--fusions", default="all", help="comma list of the fusions to turn on (default: all)")
    parser.add_argument("--all-experts", action="store_true",
                        help="route every token to every expert: no router decision a rounding can flip")
    parser.add_argument("--jsonl", default=None)
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False

    model, layers = build(args.model, args.layers, args.device, args.tiny, args.all_experts)
    names = tuple(args.fusions.split(","))
    reference = copy.deepcopy(model).float()
    vocab = model.config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (args.batch, args.prompt), generator=gen).to(args.device)
    forced = torch.randint(2, vocab, (args.batch, args.steps), generator=gen).to(args.device)

    want, _ = forced_logits(reference, ids, forced, fusions_on=False)
    plain, plain_ms = forced_logits(model, ids, forced, fusions_on=False)
    fast, fused_ms = forced_logits(model, ids, forced, fusions_on=True, names=names)
    err_plain = (plain - want).abs().mean().item()
    err_fused = (fast - want).abs().mean().item()
    ok = err_fused <= 1.1 * err_plain + 1e-5
    result = {"model": args.model, "layers": layers, "batch": args.batch, "prompt_len": args.prompt,
              "steps": args.steps, "fusions": args.fusions, "all_experts": args.all_experts,
              "experts_per_token": model.config.get_text_config(decoder=True).num_experts_per_tok,
              "device": args.device, "dtype": str(model.dtype).replace("torch.", ""),
              "err_unfused": err_plain, "err_fused": err_fused, "decode_ms_unfused": round(plain_ms, 3),
              "decode_ms_fused": round(fused_ms, 3), "ok": ok}
    print(f"{args.model} {layers} layers, {args.batch} x {args.prompt}, {args.steps} forced steps: mean |logit - fp32| "
          f"unfused {err_plain:.3e}, fused {err_fused:.3e} (limit 1.1x) -> {'ok' if ok else 'FAILED'}; decode "
          f"{plain_ms:.2f} ms/step unfused, {fused_ms:.2f} fused")
    emit(result, args.jsonl)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
