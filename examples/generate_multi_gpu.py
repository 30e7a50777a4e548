"""Generation with QSAPagedCache over several GPUs, or several CPU processes.

(a) One model split across all visible GPUs with an accelerate device map; each layer's cache
    stores live on that layer's GPU, and greedy tokens are checked against a one-GPU run
    (with fewer than two GPUs there is nothing to split: it says so and exits 0):

        python examples/generate_multi_gpu.py split [--model inkling]

(b) Data parallel with torch.distributed: one model and one cache per process, each process takes a
    strided share of the prompts, results are gathered back in prompt order on rank 0 and checked
    against rank 0 generating all prompts alone. NCCL with one GPU per process when GPUs are
    visible, else gloo on the CPU; without a launcher it runs as one process:

        torchrun --nproc_per_node 2 examples/generate_multi_gpu.py data-parallel

(c) Tensor parallel (and expert parallel): every process loads its share of one model with
    transformers' `from_pretrained(distributed_config=...)` and runs the whole batch; rank 0 checks the
    tokens against the same weights in one process. NCCL on GPUs, gloo on the CPU:

        torchrun --nproc_per_node 2 examples/generate_multi_gpu.py tp [--model inkling]
        torchrun --nproc_per_node 2 examples/generate_multi_gpu.py tp+ep

Each mode prints one OK line on rank 0, or the first differing token of each row and exits with status 1.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.utils import get_balanced_memory

from hf_qsa_cache import QSAPagedCache
from verdict import compare


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
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"SKIP: split needs at least 2 CUDA devices to split the model over, found {gpus}")
        return
    model = build(args.model)
    batch = prompts(args.prompts, model.config.vocab_size)
    max_memory = get_balanced_memory(model, no_split_module_classes=model._no_split_modules,
                                     max_memory={i: "60GiB" for i in range(gpus)})
    device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=model._no_split_modules)
    single = copy.deepcopy(model).to("cuda:0")
    reference = generate(single, batch, args.new_tokens, "cuda:0")
    del single
    torch.cuda.empty_cache()
    for i in range(gpus):
        torch.cuda.reset_peak_memory_stats(i)
    dispatch_model(model, device_map=device_map)
    start = time.perf_counter()
    tokens = generate(model, batch, args.new_tokens, 0)
    elapsed = time.perf_counter() - start
    print(f"devices used: {sorted(set(str(d) for d in device_map.values()))}")
    print(f"{len(batch) * args.new_tokens / elapsed:.1f} tokens/s")
    for i in range(gpus):
        print(f"  cuda:{i} peak memory {torch.cuda.max_memory_allocated(i) / 2**20:.1f} MiB")
    for i, row in enumerate(tokens[:4]):
        print(f"row {i}: {row}")
    compare(f"{args.model} split over {gpus} GPUs", tokens, reference, "the same model on one GPU (cuda:0)")


def data_parallel(args) -> None:
    # torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain `python` run is one process on its own.
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    if world > 1:
        dist.init_process_group(backend)

    model = build(args.model).to(device)
    batch = prompts(args.prompts, model.config.vocab_size)
    mine = list(range(rank, len(batch), world))  # strided share: rank r takes prompts r, r + world, ...
    start = time.perf_counter()
    tokens = generate(model, [batch[i] for i in mine], args.new_tokens, device) if mine else []
    results = list(zip(mine, tokens))
    gathered = [results]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
    elapsed = time.perf_counter() - start
    if world > 1:
        # Leave the group all together, before rank 0's long reference run: gloo can abort a rank ("terminate
        # called without an active exception") that tears its group down while a peer is still in it. Not in a
        # `finally`: destroying the group while a peer waits in a collective can hang instead of failing.
        dist.barrier()
        dist.destroy_process_group()

    if rank == 0:
        ordered = [row for _, row in sorted(item for part in gathered for item in part)]
        setup = f"backend {backend}, {world} processes" if world > 1 else "one plain process (no launcher)"
        print(f"{setup} on {device.type}")
        for r, part in enumerate(gathered):
            print(f"  rank {r} took {len(part)} prompt(s): {[i for i, _ in part]}")
        print(f"{len(batch) * args.new_tokens / elapsed:.1f} tokens/s")
        reference = generate(model, batch, args.new_tokens, device)  # all prompts, this process alone
        for i, row in enumerate(ordered[:4]):
            print(f"row {i}: {row}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"backend": backend, "world_size": world, "ranks": [[i for i, _ in part] for part in gathered],
                           "tokens": ordered, "reference": reference}, f)
        compare(f"data parallel over {world} process(es)", ordered, reference,
                "one process generating every prompt in one batch")


def tensor_parallel(args) -> None:
    from transformers import DistributedConfig

    world = int(os.environ.get("WORLD_SIZE", 1))
    reference = build(args.model)  # every process builds the same weights, and saves them as a checkpoint
    with tempfile.TemporaryDirectory() as checkpoint:
        reference.save_pretrained(checkpoint)
        sizes = {"tp_size": world, **({"ep_size": world} if args.mode == "tp+ep" else {})}
        model = type(reference).from_pretrained(checkpoint, distributed_config=DistributedConfig(**sizes)).eval()
    device = next(model.parameters()).device
    batch = prompts(args.prompts, model.config.vocab_size)
    start = time.perf_counter()
    tokens = generate(model, batch, args.new_tokens, device)
    elapsed = time.perf_counter() - start
    experts = next((p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")), None)
    if dist.is_initialized():
        # As in data_parallel: every rank leaves the group (transformers made it) before rank 0's reference run,
        # or a rank that exits first can abort the group under its peer.
        dist.barrier()
        dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{args.mode} over {world} process(es) on {device.type}: {len(batch) * args.new_tokens / elapsed:.1f} tokens/s")
        if experts is not None:
            local = experts.to_local().shape if hasattr(experts, "to_local") else experts.shape
            print(f"experts' gate/up weights on this rank: {tuple(local)} of {tuple(experts.shape)}")
        compare(f"{args.model} {args.mode} over {world} process(es)", tokens,
                generate(reference.to(device), batch, args.new_tokens, device),
                "the same weights in one process")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["split", "data-parallel", "tp", "tp+ep"])
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", default=None, help="data-parallel: rank 0 writes the tokens here as JSON")
    args = parser.parse_args(argv)
    {"split": split, "data-parallel": data_parallel}.get(args.mode, tensor_parallel)(args)


if __name__ == "__main__":
    main()
