"""Image-heavy prompts: transformers' ConditionalGeneration class vs ours, side by side in one run, same random
weights, bf16, one GPU.

    python benchmarks/bench_multimodal.py --model qwen4_exp --layers 8 --batch 1 --images 4 --grid 48
    python benchmarks/bench_multimodal.py --model qwen4_exp --layers 40 --batch 4 --images 2 --grid 64
    python benchmarks/bench_multimodal.py --model inkling --layers 6 --batch 1 --images 4 --grid 24

Each row's prompt is text around ``--images`` images of ``--grid x --grid`` patches (Qwen4Exp's vision tower
merges 2 x 2 patches into one token, so an image is ``grid**2 / 4`` placeholder tokens; Inkling has one token
per patch). The towers are transformers' own (Qwen4Exp: the released vision config; Inkling: its patch size). Reported per implementation (JSON lines appended to
``benchmarks/results/h200.jsonl``, key ``bench: "multimodal"``): time to the first token (vision tower and
prefill), decode ms/step (median), peak memory, and how long the greedy paths agree with upstream's (bf16
rounding differs between two correct implementations).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import transformers
from bench_generate import RESULTS, StepTimer, commit, inkling_config, qwen4_exp_config
from transformers import StoppingCriteriaList

from hf_qsa_cache import QSAPagedCache

IMAGE, VIDEO, START, END = 31990, 31991, 31992, 31993


def qwen4_exp_mm_config(layers: int):
    from transformers import Qwen4ExpConfig
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig

    text = qwen4_exp_config(layers)
    vision = Qwen4ExpVisionConfig(out_hidden_size=text.hidden_size)  # released tower: 27 blocks, width 1152
    return Qwen4ExpConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=IMAGE,
                          video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def inkling_mm_config(layers: int):
    from transformers import InklingConfig

    # The released patch size (40) with a 4-layer patch MLP (44M parameters: the config's default depth would
    # plan projections far wider than any released tower).
    text = inkling_config(layers)
    return InklingConfig(text_config=text.to_dict(), vision_config=dict(patch_size=40, num_hidden_layers=4),
                         image_token_id=IMAGE, audio_token_id=VIDEO, image_bos_token_id=START,
                         audio_bos_token_id=END)


def inkling_prompt_batch(config, batch: int, images: int, grid: int, text: int, gen: torch.Generator) -> dict:
    p, t = config.vision_config.patch_size, config.vision_config.temporal_patch_size
    rows, pixels = [], []
    for _ in range(batch):
        ids = []
        for _ in range(images):
            ids += torch.randint(4, 30000, (text,), generator=gen).tolist()
            ids += [START] + [IMAGE] * (grid * grid)
            pixels.append(torch.randn(grid * grid, t, p, p, 3, generator=gen))
        ids += torch.randint(4, 30000, (text,), generator=gen).tolist()
        rows.append(ids)
    ids = torch.tensor(rows)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.cat(pixels))


def prompt_batch(config, batch: int, images: int, grid: int, text: int, gen: torch.Generator) -> dict:
    if not hasattr(config, "vision_config") or not hasattr(config.vision_config, "spatial_merge_size"):
        return inkling_prompt_batch(config, batch, images, grid, text, gen)
    vision = config.vision_config
    features = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    rows, pixels, grids = [], [], []
    for _ in range(batch):
        ids = []
        for _ in range(images):
            ids += torch.randint(2, 30000, (text,), generator=gen).tolist()
            ids += [START] + [IMAGE] * (grid * grid // 4) + [END]
            pixels.append(torch.randn(grid * grid, features, generator=gen))
            grids.append([1, grid, grid])
        ids += torch.randint(2, 30000, (text,), generator=gen).tolist()
        rows.append(ids)
    ids = torch.tensor(rows)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE).int(),
                pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor(grids))


def run(model, inputs: dict, new_tokens: int, cache=None) -> dict:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    timer = StepTimer(start, None)
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None, stopping_criteria=StoppingCriteriaList([timer]))
    steps = [b - a for a, b in zip(timer.times, timer.times[1:])]
    return {"first_token_s": timer.times[0] - start, "decode_ms_per_step": statistics.median(steps) * 1e3,
            "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
            "tokens": out[:, inputs["input_ids"].shape[1]:]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--grid", type=int, default=48, help="patches per side of each image")
    parser.add_argument("--text", type=int, default=64, help="text tokens before each image and at the end")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-upstream", action="store_true")
    parser.add_argument("--jsonl", default=RESULTS)
    args = parser.parse_args()

    if args.model == "qwen4_exp":
        from modeling import Qwen4ExpForConditionalGeneration as Ours

        config, Upstream = qwen4_exp_mm_config(args.layers), transformers.Qwen4ExpForConditionalGeneration
    else:
        from modeling import InklingForConditionalGeneration as Ours

        config, Upstream = inkling_mm_config(args.layers), transformers.InklingForConditionalGeneration
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        ours = Ours(config).eval()
        upstream = None if args.skip_upstream else Upstream(config).eval()
    if upstream is not None:
        upstream.load_state_dict(ours.state_dict(), strict=True)
    torch.set_default_dtype(torch.float32)
    gen = torch.Generator().manual_seed(0)
    warm = {k: v.cuda() for k, v in prompt_batch(config, 1, 1, 4, 8, gen).items()}
    warm["pixel_values"] = warm["pixel_values"].bfloat16()
    run(ours, warm, 4)
    if upstream is not None:
        run(upstream, warm, 4)
    inputs = {k: v.cuda() for k, v in prompt_batch(config, args.batch, args.images, args.grid, args.text, gen).items()}
    inputs["pixel_values"] = inputs["pixel_values"].bfloat16()
    length = inputs["input_ids"].shape[1]
    common = {"bench": "multimodal", "model": args.model, "layers": args.layers, "batch": args.batch,
              "images_per_row": args.images, "image_tokens": int((inputs["input_ids"][0] == IMAGE).sum()) // args.images,
              "prompt_len": length,
              "new_tokens": args.new_tokens, "commit": commit()}
    # Warm the kernels at this shape once, then measure on a fresh cache.
    run(ours, inputs, 3, QSAPagedCache(config, args.batch, length + 3))
    rows = [{**common, "impl": "paged", "graphs": True,
             **run(ours, inputs, args.new_tokens, QSAPagedCache(config, args.batch, length + args.new_tokens))}]
    if upstream is not None:
        rows.append({**common, "impl": "upstream", "graphs": False, **run(upstream, inputs, args.new_tokens)})
    reference = rows[-1]["tokens"] if upstream is not None else None
    with open(args.jsonl, "a") as f:
        for row in rows:
            tokens = row.pop("tokens")
            if reference is not None and row["impl"] == "paged":
                agree = (tokens == reference).int().cumprod(dim=1).sum(dim=1)
                row["greedy_tokens_agreeing_per_row"] = agree.tolist()
            line = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            f.write(json.dumps(line) + "\n")
            print(json.dumps(line), flush=True)
    if upstream is not None:
        ours_row, up = rows
        print(f"first token {ours_row['first_token_s']:.2f} s vs {up['first_token_s']:.2f} s "
              f"({up['first_token_s'] / ours_row['first_token_s']:.1f}x); decode {ours_row['decode_ms_per_step']:.2f} "
              f"vs {up['decode_ms_per_step']:.2f} ms/step ({up['decode_ms_per_step'] / ours_row['decode_ms_per_step']:.1f}x)")


if __name__ == "__main__":
    main()
