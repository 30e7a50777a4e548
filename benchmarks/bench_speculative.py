"""Prompt-lookup drafting against plain greedy decoding, and the cost of a verify step, one GPU, bf16.

    python benchmarks/bench_speculative.py                                  # Qwen4Exp 8 layers, Inkling 6
    python benchmarks/bench_speculative.py --models qwen4_exp --layers 40 --draft-tokens 3
    python benchmarks/bench_speculative.py --device cpu --tiny --jsonl /tmp/spec.jsonl   # logic check (CI)
    python benchmarks/bench_speculative.py --lookup fixed                   # transformers' fixed count only

Random weights never repeat a passage on their own, so the generated text is chosen by a logits
processor that leaves one token allowed per position (`ForceContinuation`); transformers applies
it to plain decoding and to every verified position of assisted decoding alike, so both produce the
same tokens and the drafts are judged against the forced ones. The prompt is a passage of distinct
random tokens followed by its first ``--repeat`` tokens again. Three continuations:

* ``copy``: the passage goes on where the repeat stopped. Prompt lookup finds every draft in the
  prompt and (almost) all are accepted: the best case.
* ``skip``: every second token of the passage. Prompt lookup still finds the last token in the
  passage and proposes what followed it there, which is never what comes: every round drafts
  ``k`` tokens and all are rejected (a verify step of ``k + 1`` tokens yields one token): the worst case.
* ``free``: no processor, the random model's own greedy tokens: whatever prompt lookup makes of them.

For each: plain greedy ``generate()`` and ``generate(prompt_lookup_num_tokens=k)``, tokens/s of the
decode phase (tokens added after the first step / seconds from the first step to the last, so
prefill is left out of both), and for prompt lookup the acceptance rate: drafts the model accepted
/ drafts prompt lookup proposed, summed over the rounds (a round that finds no draft proposes 0;
transformers' own count of matches per round, the ``n_matches`` it passes to
``update_candidate_strategy``). Prompt lookup runs with each schedule of ``--lookup``: ``adaptive``
(what generate() does by default: `DraftBudget` shrinks the draft count after rejections, down to
paused rounds that propose nothing, and grows it back to k) and ``fixed`` (transformers' k on every
round that finds a match; ``model.adaptive_prompt_lookup = False``). Full runs measure both, tiny
runs the adaptive one. The adaptive count runs in each loop of ``--loops``: ``ours``
(`hf_qsa_cache.lookup_decoding`, what generate() takes) and ``transformers`` (its assisted-decoding loop);
full runs measure both, side by side, tiny runs ours; the fixed count always runs in transformers' loop.
The time comes from a streamer (``Clock``): marks when a loop hands tokens out. The drafter gets no
logits processor: transformers would otherwise use the forcing processor to veto wrong drafts, an oracle real prompt lookup does not have. The
tokens with drafting must equal the plain tokens; for the forced continuations the script fails
(exit status 1) if they do not, after writing the lines. Each ``generate()`` runs once to warm up
(kernel tuning, CUDA-graph capture) on the same cache, then is measured.

Step costs: the model's forward on a `QSAPagedCache` with ``num_speculative_tokens = k`` after the
same prefill: a decode step (one token; the cache grows by one) and a verify step (``k + 1``
tokens, then ``crop(-k)``: the cache grows by one, as in a round that rejects every draft), each
timed ``--steps`` times after ``--warmup`` steps, median; also a decode step on a cache without
rollback headroom (what plain ``generate()`` uses). On CUDA each step is timed with CUDA events
around the forward from an idle device (synchronized before), so host work is included.

One JSON line per measurement, appended to ``benchmarks/results/h200.jsonl`` on CUDA (``--jsonl``
to choose; on the CPU only when given). Keys: model, layers, impl ("paged"), graphs, mode ("plain",
"prompt_lookup", "decode_step", "verify_step"), lookup ("adaptive" or "fixed", prompt lookup lines), loop
("ours" or "transformers", prompt lookup lines),
continuation (generate lines), draft_tokens (k, or 0 for plain decoding and the cache without
headroom), batch (1), prompt_len, new_tokens (generated tokens; for step lines the tokens one step
feeds), tokens_per_s or step_ms, acceptance_rate, proposed / accepted drafts (proposed: the draft
tokens the forwards verified), rounds (forwards after the prefill), drafting_rounds /
rounds_without_drafts (forwards, the prefill's included, that verified some / no drafts: a round
paused by the adaptive schedule, or whose lookup found no match, verifies none), speedup (prompt
lookup tokens/s over plain), tokens_equal_plain, verify_over_decode, commit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):  # this tree's packages and bench_generate, whatever is installed
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator  # noqa: E402

from bench_generate import RESULTS, commit, inkling_config, qwen4_exp_config  # noqa: E402
from hf_qsa_cache import QSAPagedCache, lookup_decoding  # noqa: E402
from hf_qsa_cache.cuda_graphs import enabled_by_default as graphs_enabled  # noqa: E402

DEFAULT_LAYERS = {"qwen4_exp": 8, "inkling": 6}
CONTINUATIONS = ("copy", "skip", "free")
LOOKUPS = ("adaptive", "fixed")  # prompt lookup's draft count: DraftBudget, or transformers' fixed k
LOOPS = ("ours", "transformers")  # the adaptive count's loop: hf_qsa_cache.lookup_decoding, or transformers'


# ----------------------------------------------------------------------------- models
def build(name: str, layers: int | None, device: str, tiny: bool, all_experts: bool = False):
    """(model, layers). Tiny: the test suite's small configs with its randomised fp32 weights. ``all_experts``
    routes every token to every expert (no routing decision a rounding difference could flip)."""
    if tiny:
        tests = os.path.join(ROOT, "tests")
        if tests not in sys.path:
            sys.path.insert(0, tests)
        if name == "qwen4_exp":
            from helpers.qwen4 import make_pair, tiny_config as make_config
        else:
            from helpers.inkling import make_config, make_pair
        base = make_config()
        overrides = {"num_hidden_layers": layers, "layer_types": base.layer_types[:layers]} if layers else {}
        if all_experts:
            overrides["num_experts_per_tok"] = getattr(base, "num_experts", None) or base.n_routed_experts
        config = make_config(**overrides)
        model = make_pair(config)[1]
        return model.to(device).eval(), config.num_hidden_layers
    layers = layers or DEFAULT_LAYERS[name]
    if name == "qwen4_exp":
        from modeling import Qwen4ExpForCausalLM as cls

        config = qwen4_exp_config(layers)
    else:
        from modeling import InklingForCausalLM as cls

        config = inkling_config(layers)
    if all_experts:
        config.num_experts_per_tok = getattr(config, "num_experts", None) or config.n_routed_experts
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 where it runs: no fp32 copy
    try:
        with torch.device(device):
            model = cls(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return model, layers


# ----------------------------------------------------------------------------- prompt and forced text
def make_prompt(vocab: int, passage: int, repeat: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(passage, prompt): ``passage`` distinct tokens (none is pad 0 or EOS 1), then its first ``repeat`` again."""
    if not 0 < repeat < passage <= vocab - 2:
        raise ValueError(f"need 0 < repeat ({repeat}) < passage ({passage}) <= vocab - 2 ({vocab - 2})")
    gen = torch.Generator().manual_seed(seed)
    text = torch.randperm(vocab - 2, generator=gen)[:passage] + 2
    return text, torch.cat([text, text[:repeat]])


def continuation(kind: str, text: torch.Tensor, repeat: int, length: int) -> torch.Tensor | None:
    """The tokens forced after the prompt: ``copy`` resumes the passage after its repeated head, ``skip``
    takes every second token of it from there (prompt lookup proposes the token in between: wrong)."""
    n = len(text)
    j = torch.arange(length)
    if kind == "copy":
        return text[(repeat + j) % n]
    if kind == "skip":
        if length > n:  # past one lap the generated text repeats itself and lookup would find it
            raise ValueError(f"skip continuation of {length} tokens needs a passage of at least {length}")
        return text[(repeat + 1 + 2 * j) % n]
    return None


class ForceContinuation(LogitsProcessor):
    """Allows only ``stream[i]`` at the i-th position after the prompt (every other logit -inf).

    The position comes from the length of ``input_ids`` (batch of one, no padding), so it is right
    for plain decoding and for each position of a verify step alike; no host sync.
    """

    def __init__(self, stream: torch.Tensor, prompt_len: int):
        self.stream, self.prompt_len = stream, prompt_len

    def __call__(self, input_ids, scores):
        i = input_ids.shape[1] - self.prompt_len
        if not 0 <= i < len(self.stream):
            raise ValueError(f"position {i} after the prompt is outside the forced text ({len(self.stream)} tokens)")
        out = torch.full_like(scores, float("-inf"))
        return out.index_fill_(1, self.stream[i: i + 1].to(scores.device), 0.0)


# ----------------------------------------------------------------------------- generate() measurement
class Clock:
    """A streamer of generate(): each call to ``put`` marks (time, tokens so far), the prompt's first. The
    tokens come when a loop reads them, so any loop is timed as it runs (a stopping criterion would make
    our prompt-lookup loop read every round, `hf_qsa_cache.lookup_decoding`)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list[tuple[float, int]] = []

    def put(self, value):
        if self.cuda:
            torch.cuda.synchronize()
        tokens = value.numel() + (self.marks[-1][1] if self.marks else 0)
        self.marks.append((time.perf_counter(), tokens))

    def end(self):
        pass


class DraftCount:
    """Drafts proposed and accepted over a generate() call, from the candidate generator it builds.

    Installed on the model instance (generate() asks ``self._get_candidate_generator``); the prompt
    lookup generator it returns loses its logits processor (see the module docstring)."""

    def __init__(self, model):
        self.model = model
        self.proposed = self.accepted = 0
        self.rounds: list[tuple[int, int]] = []  # (proposed, accepted) per verify round

    def __enter__(self):
        count = self
        original = type(self.model)._get_candidate_generator

        def candidate_generator(model, *args, **kwargs):
            generator = original(model, *args, **kwargs)
            if isinstance(generator, PromptLookupCandidateGenerator):
                generator.logits_processor = None
            get, update = generator.get_candidates, generator.update_candidate_strategy
            pending = []

            def get_candidates(input_ids, *a, **kw):
                candidates, logits = get(input_ids, *a, **kw)
                pending.append(candidates.shape[1] - input_ids.shape[1])
                return candidates, logits

            def update_candidate_strategy(input_ids, scores, num_matches):
                proposed = pending.pop()
                count.rounds.append((proposed, int(num_matches)))
                return update(input_ids, scores, num_matches)

            generator.get_candidates = get_candidates
            generator.update_candidate_strategy = update_candidate_strategy
            return generator

        self.model._get_candidate_generator = types.MethodType(candidate_generator, self.model)
        return self

    def __exit__(self, *exc):
        del self.model._get_candidate_generator
        self.proposed = sum(p for p, _ in self.rounds)
        self.accepted = sum(a for _, a in self.rounds)


def generate(model, prompt, new_tokens, cache, processor, draft_tokens, cuda, lookup="adaptive",
             loop="ours") -> dict:
    """One greedy generate() on ``cache`` (reset first); decode-phase tokens/s, drafts when drafting
    (``lookup``: the draft count's schedule, see LOOKUPS; ``loop``: prompt lookup's loop, LOOPS)."""
    cache.reset()
    clock = Clock(cuda)
    kwargs = dict(prompt_lookup_num_tokens=draft_tokens) if draft_tokens else {}
    count = DraftCount(model)
    model.adaptive_prompt_lookup = lookup == "adaptive"
    applies = lookup_decoding.applies
    if loop == "transformers":
        lookup_decoding.applies = lambda *args, **kw: False
    try:
        with count, torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                                 max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=None,
                                 logits_processor=LogitsProcessorList([processor] if processor else []),
                                 streamer=clock, **kwargs)
    finally:
        lookup_decoding.applies = applies
        del model.adaptive_prompt_lookup  # back to the class's default
    # From the first read after the prompt (the first step's tokens) to the last.
    (t0, n0), (t1, n1) = clock.marks[1], clock.marks[-1]
    row = {"tokens_per_s": (n1 - n0) / (t1 - t0) if t1 > t0 else None,
           # forwards after the prefill: one per round (one get_candidates call each), one per token plain
           "rounds": len(count.rounds) - 1 if draft_tokens else new_tokens - 1,
           "tokens": out[0, prompt.shape[1]:].cpu()}
    if draft_tokens:
        row.update(acceptance_rate=count.accepted / count.proposed if count.proposed else None,
                   proposed=count.proposed, accepted=count.accepted, lookup=lookup, loop=loop,
                   drafting_rounds=sum(1 for p, _ in count.rounds if p),
                   rounds_without_drafts=sum(1 for p, _ in count.rounds if p == 0))
    return row


# ----------------------------------------------------------------------------- step costs
def timed(fn, cuda: bool) -> float:
    """Milliseconds of ``fn()`` started on an idle device."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def step_costs(model, prompt, k: int, steps: int, warmup: int, cuda: bool) -> list[dict]:
    """Median forward time of decode steps (cache with and without rollback headroom) and of verify
    steps of k + 1 tokens each followed by crop(-k), from the same prefill."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    out = []
    for mode, headroom, length in (("decode_step", 0, 1), ("decode_step", k, 1), ("verify_step", k, k + 1)):
        cache = QSAPagedCache(model.config, max_batch_size=1, num_speculative_tokens=headroom,
                              max_cache_len=prompt.shape[1] + warmup + steps + length)
        tokens = torch.randint(2, vocab, (warmup + steps, 1, length), generator=gen).to(prompt.device)
        times, crops = [], []
        with torch.no_grad():
            model(prompt, past_key_values=cache, logits_to_keep=1)
            for i in range(warmup + steps):
                ms = timed(lambda: model(tokens[i], past_key_values=cache), cuda)
                crop = timed(lambda: cache.crop(-(length - 1)), cuda) if length > 1 else None
                if i >= warmup:
                    times.append(ms)
                    crops.append(crop)
        assert cache.get_seq_length() == prompt.shape[1] + warmup + steps  # one token kept per step
        row = {"mode": mode, "draft_tokens": headroom, "new_tokens": length, "steps": steps,
               "step_ms": statistics.median(times)}
        if length > 1:
            row["crop_ms"] = statistics.median(crops)
        out.append(row)
    decode = next(r for r in out if r["mode"] == "decode_step" and r["draft_tokens"] == k)
    out[-1]["verify_over_decode"] = out[-1]["step_ms"] / decode["step_ms"]
    return out


# ----------------------------------------------------------------------------- one model
def bench_model(name: str, args, sha: str) -> tuple[list[dict], list[str]]:
    """Every line for one model, and what failed (forced tokens that differ with drafting)."""
    device, cuda = args.device, args.device == "cuda"
    model, layers = build(name, args.layers, device, args.tiny)
    graphs = cuda and getattr(model, "use_cuda_graphs", True) and graphs_enabled()
    k, new = args.draft_tokens, args.new_tokens
    text, prompt = make_prompt(model.config.vocab_size, args.passage, args.repeat)
    prompt = prompt[None].to(device)
    length = prompt.shape[1]
    common = {"model": name, "layers": layers, "impl": "paged", "graphs": graphs, "batch": 1,
              "prompt_len": length, "commit": sha}
    # Caches reused across calls (reset each time): CUDA graphs belong to a (model, cache) pair, so the
    # warm-up call captures what the measured call replays. Plain decoding gets no rollback headroom.
    size = length + new + 2 * k + 8
    plain_cache = QSAPagedCache(model.config, max_batch_size=1, max_cache_len=size)
    draft_cache = QSAPagedCache(model.config, max_batch_size=1, max_cache_len=size, num_speculative_tokens=k)
    rows, failures = [], []
    for kind in CONTINUATIONS:
        stream = continuation(kind, text, args.repeat, new + k + 1)
        processor = ForceContinuation(stream.to(device), length) if stream is not None else None
        measured = {}
        # Our loop serves the adaptive count only (transformers' fixed count keeps transformers' loop).
        runs = [("plain", None, None, plain_cache, 0)] + [
            ("prompt_lookup", s, loop, draft_cache, k) for s in args.lookup
            for loop in (args.loops if s == "adaptive" else ["transformers"])]
        for mode, schedule, loop, cache, drafts in runs:
            generate(model, prompt, new, cache, processor, drafts, cuda, schedule or "adaptive", loop)  # warm-up
            measured[mode, schedule, loop] = generate(model, prompt, new, cache, processor, drafts, cuda,
                                                      schedule or "adaptive", loop)
        plain = measured["plain", None, None]
        if stream is not None and not torch.equal(plain["tokens"], stream[:new]):
            failures.append(f"{name} {kind}: plain generate() did not produce the forced tokens")
        for (mode, schedule, loop), lookup in measured.items():
            if mode != "prompt_lookup":
                continue
            agree = int((plain["tokens"] == lookup["tokens"]).int().cumprod(0).sum())
            lookup["tokens_equal_plain"] = agree == new
            lookup["greedy_tokens_agreeing"] = agree
            if stream is not None and agree != new:
                failures.append(f"{name} {kind}: prompt lookup ({schedule}, {loop} loop) tokens differ from plain "
                                f"from token {agree}")
            if plain["tokens_per_s"] and lookup["tokens_per_s"]:
                lookup["speedup"] = lookup["tokens_per_s"] / plain["tokens_per_s"]
        for (mode, _, _), row in measured.items():
            row.pop("tokens")
            rows.append({**common, "mode": mode, "continuation": kind, "draft_tokens": k if mode != "plain" else 0,
                         "new_tokens": new, **row})
    for row in step_costs(model, prompt, k, args.steps, args.warmup, cuda):
        rows.append({**common, **row})
    del model, plain_cache, draft_cache
    gc.collect()  # a cache and its captured graphs refer to each other
    if cuda:
        torch.cuda.empty_cache()
    return rows, failures


def summary(rows: list[dict], k: int) -> list[str]:
    first = rows[0]
    lines = [f"{first['model']}, {first['layers']} layers, prompt {first['prompt_len']} tokens, "
             f"{first['new_tokens']} new, k = {k}, graphs {'on' if first['graphs'] else 'off'}:"]
    for kind in CONTINUATIONS:
        plain = next(r for r in rows if r["mode"] == "plain" and r["continuation"] == kind)
        lines.append(f"  {kind}: plain {plain['tokens_per_s']:.1f} tok/s")
        for look in (r for r in rows if r["mode"] == "prompt_lookup" and r["continuation"] == kind):
            rate = "n/a (no drafts)" if look["acceptance_rate"] is None else f"{look['acceptance_rate']:.2f}"
            speed = f"{look['speedup']:.2f}x" if look.get("speedup") else "n/a"
            loop = "our loop" if look["loop"] == "ours" else "transformers' loop"
            lines.append(f"    prompt lookup, {look['lookup']}, {loop}: {look['tokens_per_s']:.1f} tok/s ({speed}), "
                         f"acceptance {rate} ({look['accepted']}/{look['proposed']} drafts), {look['rounds'] + 1} "
                         f"forwards ({look['drafting_rounds']} with drafts), tokens equal plain: "
                         f"{'yes' if look['tokens_equal_plain'] else 'NO'}")
    steps = [r for r in rows if r["mode"] in ("decode_step", "verify_step")]
    bare, decode, verify = steps
    lines.append(f"  steps: decode {decode['step_ms']:.3f} ms (no headroom {bare['step_ms']:.3f} ms), verify of "
                 f"{k + 1} tokens {verify['step_ms']:.3f} ms + crop {verify['crop_ms']:.3f} ms: "
                 f"{verify['verify_over_decode']:.2f}x decode (target <= 1.5x)")
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=["qwen4_exp", "inkling"], default=["qwen4_exp", "inkling"])
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of every model run (default: qwen4_exp 8, inkling 6; tiny: the test configs)")
    parser.add_argument("--draft-tokens", type=int, default=3, help="k, prompt_lookup_num_tokens")
    parser.add_argument("--passage", type=int, default=None, help="distinct tokens of the passage (512; tiny 40)")
    parser.add_argument("--repeat", type=int, default=None, help="passage tokens repeated at the end (64; tiny 8)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens to generate (128; tiny 12)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per step kind (20; tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (5; tiny 1)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the test suite's tiny configs (fp32)")
    parser.add_argument("--jsonl", default=None, help="append lines here (default: results/h200.jsonl on CUDA)")
    parser.add_argument("--lookup", nargs="+", choices=LOOKUPS, default=None,
                        help="prompt lookup draft-count schedules to measure (adaptive fixed; tiny: adaptive)")
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=None,
                        help="loops that run the adaptive schedule (ours transformers; tiny: ours)")
    args = parser.parse_args(argv)
    defaults = dict(passage=(40, 512), repeat=(8, 64), new_tokens=(12, 128), steps=(3, 20), warmup=(1, 5),
                    lookup=(["adaptive"], list(LOOKUPS)), loops=(["ours"], list(LOOPS)))
    for key, (tiny, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    if args.jsonl is None and args.device == "cuda" and not args.tiny:
        args.jsonl = RESULTS
    if args.draft_tokens < 1:
        parser.error("--draft-tokens must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sha = commit()
    report, failures = [], []
    for name in args.models:
        rows, failed = bench_model(name, args, sha)
        failures += failed
        if args.jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(args.jsonl)), exist_ok=True)
        for row in rows:
            line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
            print(line, flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(line + "\n")
        report += summary(rows, args.draft_tokens)
    print("\n".join(report))
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    print("drafted tokens equal plain tokens (forced continuations): " + ("no" if failures else "yes"), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
