"""One rank of the tensor / expert parallel test (`tests/models/test_tensor_parallel.py`), run under torchrun on
the CPU (gloo): loads a checkpoint transformers' own class wrote with ``distributed_config``, then writes
what it computed to ``<out>/rank<r>.json``.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/tp_worker.py <family> <checkpoint> <out>
"""

from __future__ import annotations

import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers import DistributedConfig  # noqa: E402

from hf_qsa_cache import QSAPagedCache  # noqa: E402
from modeling import InklingForCausalLM, Qwen4ExpForCausalLM  # noqa: E402

MODES = {"tp": {"tp_size": 2}, "tp+ep": {"tp_size": 2, "ep_size": 2}}
NEW = 5


def batch(vocab: int):
    gen = torch.Generator().manual_seed(0)
    lengths = [23, 9, 17]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
    return prompts, ids, mask


def local_shape(p) -> list[int]:
    return list(p.to_local().shape if hasattr(p, "to_local") else p.shape)


def main():
    family, checkpoint, out = sys.argv[1:4]
    cls = Qwen4ExpForCausalLM if family == "qwen4_exp" else InklingForCausalLM
    result = {}
    for mode, kwargs in MODES.items():
        model = cls.from_pretrained(checkpoint, distributed_config=DistributedConfig(**kwargs), dtype=torch.float32)
        model.eval()
        model.generation_config.eos_token_id = None
        prompts, ids, mask = batch(model.config.vocab_size)
        cache = QSAPagedCache(model.config, max_batch_size=3, max_cache_len=ids.shape[1] + NEW, block_size=4)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits[:, -1]
            tokens = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW,
                                    do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
        experts = next(p for n, p in model.named_parameters() if n.endswith("mlp.experts.gate_up_proj"))
        result[mode] = {"tokens": tokens.tolist(), "logits": logits.tolist(), "experts_local": local_shape(experts),
                        "experts_global": list(experts.shape)}
        del model
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Leave the process group (transformers' loading started it) before exit: torn down by the interpreter's exit
    # instead, its threads could be destroyed still running, which aborts the rank ("terminate called without an
    # active exception", seen once on a loaded machine).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
