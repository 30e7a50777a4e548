"""Multimodal models on the CUDA path (Triton kernels, CUDA-graph decode): fp32, the ragged batches of
tests/test_multimodal_*.py (rows with their own images / video / audio, left-padded), every row's greedy tokens and
logits (within 1e-3) equal to upstream transformers on that row alone on the CPU; with graphs on, decode steps
replayed from CUDA graphs.

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_multimodal.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_qsa_cache import QSAPagedCache

pytestmark = pytest.mark.gpu

NEW = 8
TOLERANCE = 1e-3


@functools.cache
def family(name: str):
    """(upstream model, ours with its weights, row ids, batch of rows -> inputs, upstream per row alone)."""
    import transformers

    from modeling import InklingForConditionalGeneration, Qwen4ExpForConditionalGeneration

    torch.manual_seed(0)
    if name == "qwen4_exp":
        import test_multimodal_qwen4_exp as q

        ref = transformers.Qwen4ExpForConditionalGeneration(q.mm_config()).eval()
        q.randomize_(ref, 0)
        ours = Qwen4ExpForConditionalGeneration(q.mm_config()).eval()
        rows, batch = q.ROWS, q.batch
    else:
        import test_multimodal_inkling as k

        ref = k.UpstreamInkling(k.make_config()).eval()
        k.randomize_(ref, 0)
        ours = InklingForConditionalGeneration(k.make_config()).eval()
        data = k.Batch()

        def batch(rows):
            if len(rows) == 1:
                ids = data.row(rows[0])
                return dict(input_ids=ids, attention_mask=torch.ones_like(ids), **data.media(rows[0]))
            return dict(input_ids=data.ids, attention_mask=data.mask, **data.media())

        rows = list(range(len(data.rows)))
    ours.load_state_dict(ref.state_dict())
    alone = []
    for r in rows:
        with torch.no_grad():
            res = ref.generate(**batch([r]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        alone.append((res.sequences[0, -NEW:].tolist(), torch.stack(res.logits, 1)[0]))
    return ours, rows, batch, alone


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", ["qwen4_exp", "inkling"])
def test_ragged_batch_with_media_equals_upstream_per_row(name, graphs):
    ours, rows, batch, alone = family(name)
    inputs = {k: v.cuda() for k, v in batch(rows).items()}
    width = inputs["input_ids"].shape[1]
    ours = ours.cuda()
    ours.use_cuda_graphs = graphs
    cache = QSAPagedCache(ours.config, max_batch_size=len(rows), max_cache_len=width + NEW, block_size=8)
    with torch.no_grad():
        res = ours.generate(**inputs, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(res.logits, 1).cpu()
    for i, (tokens, ref_logits) in enumerate(alone):
        assert res.sequences[i, width:].tolist() == tokens, f"row {i} tokens"
        err = (logits[i] - ref_logits).abs().max().item()
        assert err < TOLERANCE, f"row {i}: logits {err:.2e} from upstream"
    if graphs:
        recorded = sum(1 for r in cache.graph_runners.values() for b in r.buckets.values() if b.graph)
        assert recorded > 0, "no decode step was captured in a CUDA graph"
