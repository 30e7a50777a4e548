"""Multi-GPU generation with QSAPagedCache (falls back to the CPU when no GPU is visible).

(a) One model split across all visible GPUs with an accelerate device map; each layer's cache
    stores live on that layer's GPU, and greedy tokens are checked against a one-device run:

        python examples/generate_multi_gpu.py split [--model inkling]

(b) Data parallel: one model and one cache per process, prompts split across processes, results
    gathered back in prompt order:

        accelerate launch --num_processes 2 examples/generate_multi_gpu.py data-parallel
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from accelerate import PartialState, dispatch_model, infer_auto_device_map
from accelerate.utils import gather_object, get_balanced_memory

from hf_qsa_cache import QSAPagedCache


def build(model_name: str):
    if model_name == "qwen4_exp":
        from generate_qwen4_exp import small_config

        from modeling import Qwen4ExpForCausalLM as Model
    else:
        from generate_inkling import small_config

        from modeling import InklingForCausalLM as Model
    torch.manual_seed(0)  # every process builds the same weights
    return Model(small_config()).eval()


def prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 96, (n,), generator=gen).tolist()
    return [torch.randint(2, vocab, (k,), generator=gen).tolist() for k in lengths]


def generate(model, batch: list[list[int]], new_tokens: int, device) -> list[list[int]]:
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    cache = QSAPagedCache(model.config, max_batch_size=len(batch), max_cache_len=width + new_tokens, block_size=16)
    out = model.generate(ids.to(device), attention_mask=mask.to(device), past_key_values=cache,
                         max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, width:].tolist()


def split(args) -> None:
    model = build(args.model)
    batch = prompts(args.prompts, model.config.vocab_size)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        device_map = {"": "cpu"}
        first = "cpu"
    else:
        max_memory = get_balanced_memory(model, no_split_module_classes=model._no_split_modules,
                                         max_memory={i: "60GiB" for i in range(gpus)})
        device_map = infer_auto_device_map(model, max_memory=max_memory,
                                           no_split_module_classes=model._no_split_modules)
        first = 0
    reference = None
    if gpus:
        single = copy.deepcopy(model).to("cuda:0")
        reference = generate(single, batch, args.new_tokens, "cuda:0")
        del single
        torch.cuda.empty_cache()
        for i in range(gpus):
            torch.cuda.reset_peak_memory_stats(i)
    dispatch_model(model, device_map=device_map)
    start = time.perf_counter()
    tokens = generate(model, batch, args.new_tokens, first)
    elapsed = time.perf_counter() - start
    print(f"devices used: {sorted(set(str(d) for d in device_map.values()))}")
    print(f"{len(batch) * args.new_tokens / elapsed:.1f} tokens/s")
    for i in range(gpus):
        print(f"  cuda:{i} peak memory {torch.cuda.max_memory_allocated(i) / 2**20:.1f} MiB")
    if reference is not None:
        print(f"tokens identical to a one-GPU run: {tokens == reference}")
    for i, row in enumerate(tokens[:4]):
        print(f"row {i}: {row}")


def data_parallel(args) -> None:
    state = PartialState()
    model = build(args.model).to(state.device)
    batch = prompts(args.prompts, model.config.vocab_size)
    indexed = list(enumerate(batch))
    state.wait_for_everyone()
    start = time.perf_counter()
    with state.split_between_processes(indexed) as mine:
        results = list(zip([i for i, _ in mine], generate(model, [p for _, p in mine], args.new_tokens, state.device)))
    gathered = gather_object(results)
    state.wait_for_everyone()
    elapsed = time.perf_counter() - start
    if state.is_main_process:
        ordered = [tokens for _, tokens in sorted(gathered, key=lambda item: item[0])]
        print(f"{state.num_processes} process(es): {len(batch) * args.new_tokens / elapsed:.1f} tokens/s")
        for i, row in enumerate(ordered[:4]):
            print(f"row {i}: {row}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["split", "data-parallel"])
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    split(args) if args.mode == "split" else data_parallel(args)


if __name__ == "__main__":
    main()
