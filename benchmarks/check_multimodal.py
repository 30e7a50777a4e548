"""Multimodal models on the CUDA path (Triton kernels, CUDA-graph decode): fp32, the ragged batch of
tests/test_multimodal_*.py (rows with their own images / video / audio, left-padded), every row's greedy tokens
and logits (within 1e-3) equal to upstream transformers on that row alone on the CPU, and decode steps replayed
from CUDA graphs.

    python benchmarks/check_multimodal.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from hf_qsa_cache import QSAPagedCache  # noqa: E402

NEW = 8


def check(name, ref, ours, rows, batch, tol=1e-3) -> bool:
    alone = []
    for r in rows:
        with torch.no_grad():
            res = ref.generate(**batch([r]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        alone.append((res.sequences[0, -NEW:].tolist(), torch.stack(res.logits, 1)[0]))
    inputs = {k: v.cuda() for k, v in batch(rows).items()}
    width = inputs["input_ids"].shape[1]
    ours = ours.cuda()
    ok = True
    for graphs in (True, False):
        ours.use_cuda_graphs = graphs
        cache = QSAPagedCache(ours.config, max_batch_size=len(rows), max_cache_len=width + NEW, block_size=8)
        with torch.no_grad():
            res = ours.generate(**inputs, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
        replayed = sum(1 for r in cache.graph_runners.values() for b in r.buckets.values() if b.graph)
        logits = torch.stack(res.logits, 1).cpu()
        for i, (tokens, ref_logits) in enumerate(alone):
            same = res.sequences[i, width:].tolist() == tokens
            err = (logits[i] - ref_logits).abs().max().item()
            ok &= same and err < tol
            print(f"{name} graphs={graphs} row {i}: tokens equal {same}, max logit error {err:.2e}")
        print(f"{name} graphs={graphs}: decode graphs recorded {replayed}")
        ok &= replayed > 0 if graphs else True
    return ok


def main():
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the vision towers' matmuls and convolutions)
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    results = []
    import test_multimodal_qwen4_exp as q
    import transformers

    from modeling import Qwen4ExpForConditionalGeneration

    ref = transformers.Qwen4ExpForConditionalGeneration(q.mm_config()).eval()
    q.randomize_(ref, 0)
    ours = Qwen4ExpForConditionalGeneration(q.mm_config()).eval()
    ours.load_state_dict(ref.state_dict())
    results.append(check("qwen4_exp", ref, ours, q.ROWS, q.batch))
    import test_multimodal_inkling as k

    from modeling import InklingForConditionalGeneration

    ref = k.UpstreamInkling(k.make_config()).eval()
    k.randomize_(ref, 0)
    ours = InklingForConditionalGeneration(k.make_config()).eval()
    ours.load_state_dict(ref.state_dict())
    data = k.Batch()

    def inkling_batch(rows):
        if len(rows) == 1:
            ids = data.row(rows[0])
            return dict(input_ids=ids, attention_mask=torch.ones_like(ids), **data.media(rows[0]))
        return dict(input_ids=data.ids, attention_mask=data.mask, **data.media())

    results.append(check("inkling", ref, ours, list(range(len(data.rows))), inkling_batch))
    print("ALL MULTIMODAL CHECKS PASSED" if all(results) else "MULTIMODAL CHECKS FAILED")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
