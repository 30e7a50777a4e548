"""Images, video and audio in, text out, on QSAPagedCache: small random multimodal models (no downloads).

    python examples/generate_multimodal.py [--model qwen4_exp|inkling|both] [--device cuda]

Qwen4Exp: a left-padded batch of three rows, one with two images, one with a video and an image, one text only.
Inkling: one row with an image and an audio clip, one text only. Media tensors are synthetic, laid out as the
processors lay them out. Each family generates on one `QSAPagedCache`, then every row is checked against
transformers' own class holding the same weights (`Qwen4ExpForConditionalGeneration`,
`InklingForConditionalGeneration`) generating that row alone, unpadded, fp32 on the CPU. Prints one OK line per
family, or the first differing token of each row and exits with status 1.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
from transformers import InklingConfig, Qwen4ExpConfig
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig

from hf_qsa_cache import QSAPagedCache
from modeling import InklingForConditionalGeneration, Qwen4ExpForConditionalGeneration

from generate_qwen4_exp import small_config  # this folder's text example
from verdict import compare, greedy, transformers_twin

NEW_TOKENS = 12


# ----------------------------------------------------------------------------------------------- Qwen4Exp
QWEN_IMAGE, QWEN_VIDEO, QWEN_START, QWEN_END = 500, 501, 502, 503


def qwen_model() -> Qwen4ExpForConditionalGeneration:
    text = small_config()  # examples/generate_qwen4_exp.py's text model
    vision = Qwen4ExpVisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=4,
                                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128,
                                  num_position_embeddings=64)
    config = Qwen4ExpConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=QWEN_IMAGE,
                            video_token_id=QWEN_VIDEO, vision_start_token_id=QWEN_START,
                            vision_end_token_id=QWEN_END)
    return Qwen4ExpForConditionalGeneration(config)


def qwen_rows(gen) -> list[dict]:
    """Each row: ids, and its images / videos as (patches, grid) with ``grid = [t, h, w]`` in patches."""
    features = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch
    text = lambda n: torch.randint(2, 500, (n,), generator=gen).tolist()  # noqa: E731

    def image(h, w):
        return [QWEN_START] + [QWEN_IMAGE] * (h * w // 4) + [QWEN_END], (torch.randn(h * w, features, generator=gen),
                                                                         [1, h, w])

    def video(t, h, w):  # one placeholder run per frame, each after a timestamp token
        ids = sum((text(1) + [QWEN_START] + [QWEN_VIDEO] * (h * w // 4) + [QWEN_END] for _ in range(t)), [])
        return ids, (torch.randn(t * h * w, features, generator=gen), [t, h, w])

    rows = []
    for parts in ([30, ("image", 8, 8), 10, ("image", 4, 6), 20], [12, ("video", 2, 6, 6), 8, ("image", 6, 4), 9],
                  [57]):
        row = {"ids": [], "images": [], "videos": []}
        for part in parts:
            if isinstance(part, int):
                row["ids"] += text(part)
            else:
                ids, media = (image if part[0] == "image" else video)(*part[1:])
                row["ids"] += ids
                row["images" if part[0] == "image" else "videos"].append(media)
        rows.append(row)
    return rows


def qwen_inputs(rows: list[dict]) -> dict:
    width = max(len(r["ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r["ids"]):] = torch.tensor(r["ids"])
        mask[i, width - len(r["ids"]):] = 1
    out = dict(input_ids=ids, attention_mask=mask,
               mm_token_type_ids=(ids == QWEN_IMAGE).int() + 2 * (ids == QWEN_VIDEO).int())
    for kind, pixels, grid in (("images", "pixel_values", "image_grid_thw"),
                               ("videos", "pixel_values_videos", "video_grid_thw")):
        media = [m for r in rows for m in r[kind]]
        if media:
            out[pixels] = torch.cat([m[0] for m in media])
            out[grid] = torch.tensor([m[1] for m in media])
    return out


# ----------------------------------------------------------------------------------------------- Inkling
INK_BOS, INK_IMAGE_BOS, INK_AUDIO_BOS, INK_IMAGE, INK_AUDIO = 1, 2, 3, 254, 255
PATCH, MEL_BINS, DMEL_BINS = 4, 8, 16


def inkling_model() -> InklingForConditionalGeneration:
    text = dict(
        vocab_size=256, unpadded_vocab_size=250, hidden_size=128, num_hidden_layers=6,
        layer_types=["hybrid_sliding"] * 5 + ["hybrid"], num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=32, sliding_window_size=32, d_rel=8,
        rel_extent=64, conv_kernel_size=4, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8,
        num_experts_per_tok=2, pad_token_id=0, bos_token_id=INK_BOS, eos_token_id=None,
    )
    config = InklingConfig(text_config=text, vision_config=dict(patch_size=PATCH, temporal_patch_size=2),
                           audio_config=dict(n_mel_bins=MEL_BINS, mel_vocab_size=DMEL_BINS),
                           image_token_id=INK_IMAGE, audio_token_id=INK_AUDIO, image_bos_token_id=INK_IMAGE_BOS,
                           audio_bos_token_id=INK_AUDIO_BOS)
    return InklingForConditionalGeneration(config)


def inkling_inputs(gen) -> tuple[dict, list[dict]]:
    """Row 0: text, a 5 x 6-patch image, text, a 7-frame audio clip, text. Row 1: text only. Returns the batch's
    inputs and each row's own inputs."""
    text = lambda n: torch.randint(4, 250, (n,), generator=gen).tolist()  # noqa: E731
    pixels = torch.randn(30, 2, PATCH, PATCH, 3, generator=gen)  # [patches, time, patch, patch, channels]
    audio = torch.randint(0, DMEL_BINS, (1, 7, MEL_BINS), generator=gen)  # dMel bins [clips, frames, mel bins]
    rows = [[INK_BOS] + text(20) + [INK_IMAGE_BOS] + [INK_IMAGE] * 30 + text(9) + [INK_AUDIO_BOS]
            + [INK_AUDIO] * 7 + text(15), [INK_BOS] + text(41)]
    media = [dict(pixel_values=pixels, audio_input_ids=audio, audio_input_ids_mask=torch.ones(1, 7, dtype=torch.long)),
             {}]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    alone = [dict(input_ids=torch.tensor([r]), attention_mask=torch.ones(1, len(r), dtype=torch.long), **m)
             for r, m in zip(rows, media)]
    return dict(input_ids=ids, attention_mask=mask, **media[0]), alone


# ----------------------------------------------------------------------------------------------- both
def generate(model, inputs: dict, rows: int, device) -> torch.Tensor:
    inputs = {k: v.to(device) for k, v in inputs.items()}
    width = inputs["input_ids"].shape[1]
    cache = QSAPagedCache(model.config, max_batch_size=rows, max_cache_len=width + NEW_TOKENS)
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[:, width:].cpu()


def demo(name, model, batch_inputs, alone_inputs, device, transformers_class) -> None:
    start = time.perf_counter()
    tokens = generate(model, batch_inputs, len(alone_inputs), device)
    elapsed = time.perf_counter() - start
    print(f"{name}: {len(alone_inputs)} rows, prompt width {batch_inputs['input_ids'].shape[1]}, "
          f"{NEW_TOKENS} new tokens in {elapsed:.2f} s")
    for i, row in enumerate(tokens.tolist()):
        print(f"  row {i}: {row}")
    twin = transformers_twin(model, transformers_class)
    want = [greedy(twin, NEW_TOKENS, **inputs) for inputs in alone_inputs]
    compare(name, tokens.tolist(), want,
            f"transformers' {transformers_class.__name__} (same weights, fp32, CPU) on each row alone, unpadded")


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling", "both"], default="both")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if args.model in ("qwen4_exp", "both"):
        model = qwen_model().to(args.device).eval()
        rows = qwen_rows(gen)
        demo("qwen4_exp", model, qwen_inputs(rows), [qwen_inputs([r]) for r in rows], args.device,
             transformers.Qwen4ExpForConditionalGeneration)
    if args.model in ("inkling", "both"):
        model = inkling_model().to(args.device).eval()
        batch_inputs, alone = inkling_inputs(gen)
        demo("inkling", model, batch_inputs, alone, args.device, transformers.InklingForConditionalGeneration)


if __name__ == "__main__":
    main()
