"""Correctness of the CUDA path (Triton metadata and short-conv kernels inside whole models).

Our models run on the GPU in fp32 with a ragged batch; every row must give the greedy tokens and
(within 1e-3) the logits of upstream transformers run on that row alone, unpadded, fp32, on the CPU.

    python benchmarks/gpu_checks.py
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from hf_qsa_cache import QSAPagedCache  # noqa: E402

NEW = 12


def check_rows(name, upstream, ours_gpu, prompts, block_size):
    from qwen4_helpers import left_pad

    ids, mask = left_pad(prompts)
    width = ids.shape[1]
    cache = QSAPagedCache(ours_gpu.config, len(prompts), width + NEW, block_size=block_size)
    out = ours_gpu.generate(ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache, max_new_tokens=NEW,
                            do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                            return_dict_in_generate=True)
    worst, ok = 0.0, True
    for i, p in enumerate(prompts):
        ref = upstream.generate(torch.as_tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        same = out.sequences[i, width:].cpu().tolist() == ref.sequences[0, len(p):].tolist()
        diff = (torch.stack([l[i].cpu() for l in out.logits]) - torch.stack([l[0] for l in ref.logits])).abs().max()
        worst = max(worst, diff.item())
        ok &= same and diff.item() < 1e-3
    print(f"{name}: rows {len(prompts)}, greedy tokens equal and logits within 1e-3: {ok} (max diff {worst:.2e})")
    return ok


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = []

    import qwen4_helpers as q

    import hf_qsa_cache.ops.qsa as qsa_ops

    upstream, ours = q.make_pair(seed=0)
    prompts = q.random_prompts([29, 7, 18, 33, 25], seed=1)
    results.append(check_rows("qwen4_exp", upstream, copy.deepcopy(ours).cuda(), prompts, block_size=4))
    # The opt-in Triton QSA kernels (HF_QSA_TRITON_QSA=1) inside the whole model.
    saved, qsa_ops.USE_TRITON = qsa_ops.USE_TRITON, True
    try:
        results.append(check_rows("qwen4_exp (Triton QSA kernels)", upstream, copy.deepcopy(ours).cuda(), prompts,
                                  block_size=4))
    finally:
        qsa_ops.USE_TRITON = saved

    import test_inkling as ink

    upstream, ours = ink.make_pair(ink.make_config())
    prompts = [p.tolist() for p in ink.make_prompts([9, 3, 14, 6, 21])]
    results.append(check_rows("inkling", upstream, copy.deepcopy(ours).cuda(), prompts, block_size=4))
    print("ALL GPU CHECKS PASSED" if all(results) else "GPU CHECK FAILED")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
