"""Capture one decode step and one verify step of each model in a CUDA graph and show where a capture
fails (the graphed runner only warns and falls back to eager).

    python benchmarks/check_capture.py
"""

from __future__ import annotations

import traceback

import torch

from bench_generate import inkling_config, qwen4_exp_config
from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.cuda_graphs import graphs_of


def check(name: str, model, config, step_len: int) -> bool:
    cache = QSAPagedCache(config, max_batch_size=2, max_cache_len=1024, num_speculative_tokens=3)
    ids = torch.randint(2, 1000, (2, 600), device="cuda")
    with torch.no_grad():
        model(ids, past_key_values=cache, logits_to_keep=1)
        runner = graphs_of(model, cache, torch.device("cuda", torch.cuda.current_device()))
        step = torch.randint(2, 1000, (2, step_len), device="cuda")
        with cache.transaction(2, step_len, None) as (prev, counts):
            entry = runner._new_bucket(2, step_len, {})
            runner._fill(entry, prev, counts, step, None)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                runner._eager(entry)  # eager first: compiles the kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    runner._recorded(entry)
            except Exception:
                print(f"{name} step of {step_len}: capture FAILED")
                traceback.print_exc()
                return False
    print(f"{name} step of {step_len}: captured")
    return True


def main():
    torch.manual_seed(0)
    ok = True
    torch.set_default_dtype(torch.bfloat16)
    from modeling import InklingForCausalLM, Qwen4ExpForCausalLM

    for name, cls, config in [("inkling", InklingForCausalLM, inkling_config(6)),
                              ("qwen4_exp", Qwen4ExpForCausalLM, qwen4_exp_config(4))]:
        with torch.device("cuda"):
            model = cls(config).eval()
        for step_len in (1, 4):
            ok &= check(name, model, config, step_len)
    print("ALL CAPTURED" if ok else "SOME CAPTURES FAILED")


if __name__ == "__main__":
    main()
