"""bf16 teacher-forced logit error against upstream fp32, with MoE routing flips counted per token.

    python benchmarks/bf16_error.py --lens 1000,800,600 --seeds 0,1,2                    # CPU
    python benchmarks/bf16_error.py --device cuda --lens 3000,2000,1000 --ops torch      # CUDA, torch attention op
    python benchmarks/bf16_error.py --kw "dict(dense_mlp_idx=5)"                         # Inkling, dense MLPs only
    python benchmarks/bf16_error.py --family qwen4_exp --lens 600,400 --seeds 0,1

Same random weights as upstream fp32 (the reference), upstream bf16 (one forward over prompt and
forced tokens) and ours bf16 (a left-padded ragged prefill, then one decode step per forced token).
Inkling: the tests' small config widened to hidden 256, window 200, relative extent 64 (``--kw``
overrides any field); Qwen4Exp: the tests' tiny config. A token counts as flipped for a model when
any MoE router picks other experts for it than upstream fp32 does: such a token's logit error is
tens of times the others', so over a few tokens the mean error counts flips. Printed: the ratio
(ours / upstream bf16) over all tokens, over each model's unflipped tokens, and over the tokens that
neither flipped.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]  # this checkout's package and the tests' model helpers

import torch  # noqa: E402

from hf_qsa_cache import QSAPagedCache  # noqa: E402
from hf_qsa_cache.ops import inkling_attention  # noqa: E402


def build(args, seed: int):
    if args.family == "inkling":
        import helpers.inkling as ink

        config = ink.make_config(**{**dict(hidden_size=256, sliding_window_size=200, rel_extent=64,
                                           max_position_embeddings=8192), **eval(args.kw)})
        upstream, ours = ink.make_pair(config, seed=seed, std=args.std)
    else:
        import helpers.qwen4 as q

        config = q.tiny_config(**{"max_position_embeddings": 8192, **eval(args.kw)})
        upstream, ours = q.make_pair(config, seed=seed)
    return upstream, ours, config.vocab_size


def record_routing(model, store: dict) -> list:
    """Hooks appending each router's chosen experts (sorted per token) to ``store[router name]``."""
    hooks = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Router"):
            def hook(mod, inputs, out, name=name):
                store.setdefault(name, []).append(out[2].detach().sort(-1).values.cpu())
            hooks.append(module.register_forward_hook(hook))
    return hooks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=["inkling", "qwen4_exp"], default="inkling")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lens", default="1000", help="prompt lengths, one row each")
    ap.add_argument("--forced", type=int, default=16)
    ap.add_argument("--std", type=float, default=0.1, help="Inkling weights' std")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--kw", default="{}", help="config overrides, a Python dict expression")
    ap.add_argument("--ops", choices=["triton", "torch"], default="triton", help="Inkling attention on CUDA")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.ops == "torch":  # the attention's torch specification on CUDA too, in place of the dispatch's kernel
        from modeling import modeling_inkling

        modeling_inkling.paged_rel_attention = inkling_attention.paged_rel_attention_torch
    from helpers.qwen4 import left_pad

    dev, F = args.device, args.forced
    lens = [int(x) for x in args.lens.split(",")]
    errs = {k: [] for k in ("up", "ours", "up_kept", "ours_kept", "both_up", "both_ours")}
    flips = {"up": 0, "ours": 0}
    for seed in (int(s) for s in args.seeds.split(",")):
        upstream, ours, vocab = build(args, seed)
        g = torch.Generator().manual_seed(100 + seed)
        prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]
        forced = torch.randint(2, vocab, (len(lens), F), generator=g)
        up32 = upstream.to(dev)
        up16 = copy.deepcopy(upstream).to(dev, torch.bfloat16)
        ours16 = copy.deepcopy(ours).to(dev, torch.bfloat16)
        ours16.use_cuda_graphs = False
        with torch.no_grad():
            ids, mask = left_pad(prompts)
            ids, mask = ids.to(dev), mask.to(dev)
            width = ids.shape[1]
            cache = QSAPagedCache(ours16.config, len(lens), width + F, block_size=16)
            routed = {}
            hooks = record_routing(ours16, routed)
            steps = [ours16(ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1).logits[:, -1]]
            for t in range(F - 1):
                tok = forced[:, t:t + 1].to(dev)
                mask = torch.cat([mask, torch.ones_like(tok)], 1)
                steps.append(ours16(tok, attention_mask=mask, past_key_values=cache).logits[:, -1])
            for h in hooks:
                h.remove()
            mine = torch.stack(steps, 1).float().cpu()
            for i, p in enumerate(prompts):
                seq = torch.tensor([p + forced[i, :F - 1].tolist()], device=dev)
                r32, r16 = {}, {}
                hooks = record_routing(up32, r32)
                ref = up32(seq).logits[0, len(p) - 1:].float().cpu()
                hooks += record_routing(up16, r16)
                e_up = (up16(seq).logits[0, len(p) - 1:].float().cpu() - ref).abs().mean(-1)
                for h in hooks:
                    h.remove()
                e_ours = (mine[i] - ref).abs().mean(-1)
                f_up = torch.zeros(F, dtype=torch.bool)
                f_ours = torch.zeros(F, dtype=torch.bool)
                for name, chosen in r32.items():
                    want = chosen[0][len(p) - 1:]
                    f_up |= (r16[name][0][len(p) - 1:] != want).any(-1)
                    mine_chosen = [routed[name][0].view(len(lens), width, -1)[i, -1]]
                    mine_chosen += [routed[name][s].view(len(lens), -1)[i] for s in range(1, F)]
                    f_ours |= (torch.stack(mine_chosen) != want).any(-1)
                both = ~f_up & ~f_ours
                errs["up"].append(e_up)
                errs["ours"].append(e_ours)
                errs["up_kept"].append(e_up[~f_up])
                errs["ours_kept"].append(e_ours[~f_ours])
                errs["both_up"].append(e_up[both])
                errs["both_ours"].append(e_ours[both])
                flips["up"] += int(f_up.sum())
                flips["ours"] += int(f_ours.sum())
                print(f"seed {seed} row {i} (len {len(p)}): upstream bf16 {e_up.mean():.3e} ours {e_ours.mean():.3e}; "
                      f"flipped steps upstream {f_up.nonzero().flatten().tolist()} "
                      f"ours {f_ours.nonzero().flatten().tolist()}", flush=True)
    m = {k: torch.cat(v).mean().item() for k, v in errs.items()}
    print(f"{args.family} on {dev} (attention {args.ops}), rows {lens}, std {args.std}, overrides {args.kw}: "
          f"{sum(len(e) for e in errs['up'])} tokens, routing flipped upstream bf16 {flips['up']}, "
          f"ours {flips['ours']}")
    for label, u, o in (("all tokens", "up", "ours"), ("each without its flipped tokens", "up_kept", "ours_kept"),
                        ("tokens neither flipped", "both_up", "both_ours")):
        print(f"  {label}: mean |logit - upstream fp32| upstream bf16 {m[u]:.4e}, ours {m[o]:.4e}: "
              f"ratio {m[o] / m[u]:.2f}")


if __name__ == "__main__":
    main()
