"""Model-based stress test of the continuous-batching engine: a seeded random sequence of request arrivals,
cancellations and waits against a running engine on a tight block pool, with faults injected at random
calls of its iterations: in a model step (at a random torch call inside the forward, after some layers wrote)
and in its own bookkeeping (row moves, admission, row order, room checks).

Every request must end with exactly one final result, and that result must be
* its tokens from transformers' own model on its prompt alone (greedy; a fifth of the requests with a repetition
  penalty, whose history must follow the request through row moves, preemption and faults), or
* FAILED because two steps it was in failed, or bookkeeping failed three iterations in a row (the injected error), or
* FAILED "cancelled" when it was cancelled;
and at the end every block is back in its pool (or cached by prefix caching and idle), no row is held, no media
encoding or id is left behind. With ``shared=True`` prompts continue a few common prefixes (cut anywhere) and
earlier requests' prompts and answers, so rows start from cached prefixes while faults fire. With
``graph_path=True`` (``--graph-path``) every step a GPU would replay from a CUDA graph takes the recorded step's path
(from its static buffers), which the CPU otherwise never runs.

CI runs a short sequence (tests/serving/test_engine_reliability.py); run a long one with
``python tests/helpers/engine_stress.py --family inkling --ops 2000 --seed 0``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: `helpers`
from helpers.faults import FailAt, Injected  # noqa: E402
from helpers.qwen4 import random_prompts  # noqa: E402
from helpers.serving import alone, family_pair, greedy, pools_full, steps_routed_as_on_a_gpu  # noqa: E402
from transformers import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.requests import RequestStatus  # noqa: E402

from hf_qsa_cache import QSAPagedCache  # noqa: E402
from hf_qsa_cache.serving import Sampling  # noqa: E402
from hf_qsa_cache.serving.runner import ModelRunner  # noqa: E402
from hf_qsa_cache.serving.scheduler import Scheduler  # noqa: E402

# Where faults go: (owner, method). `_forward`, `_forward_grouped` and `_forward_mixed` are the model's steps; the
# others are the loop's bookkeeping.
MODEL_STEPS = ("_forward", "_forward_grouped", "_forward_mixed")
PENALTY = 1.8  # a penalized request's repetition penalty (strong enough to change greedy tokens)
FAULT_SITES = [(ModelRunner, "_forward"), (ModelRunner, "_forward_grouped"), (ModelRunner, "_forward_mixed"),
               (QSAPagedCache, "move_rows"),
               (Scheduler, "admit"), (Scheduler, "order"), (ModelRunner, "why_not_fits")]


class Faults:
    """Raises `Injected` at every n-th call of the fault sites, n drawn anew after each fault."""

    def __init__(self, rng: random.Random, every: tuple[int, int]):
        self.rng, self.every = rng, every
        self.countdown = rng.randint(*every)
        self.fired: dict[str, int] = {}
        self.originals = []

    def install(self) -> None:
        for owner, name in FAULT_SITES:
            original = getattr(owner, name)
            self.originals.append((owner, name, original))
            setattr(owner, name, self._wrap(name, original))

    def remove(self) -> None:
        for owner, name, original in self.originals:
            setattr(owner, name, original)
        self.originals = []

    def _wrap(self, name, original):
        def faulty(*args, **kwargs):
            self.countdown -= 1
            if self.countdown > 0:
                return original(*args, **kwargs)
            self.countdown = self.rng.randint(*self.every)
            if name not in MODEL_STEPS:
                self.fired[name] = self.fired.get(name, 0) + 1
                raise Injected(f"injected fault in {name}")
            # A model step fails at a random torch call inside it, after some layers wrote their state (the
            # engine's cache keeps no undo copies: the rows it fed are lost, their requests fail, the others go
            # on); a step with fewer calls ends normally.
            try:
                with FailAt(self.rng.randint(1, 400)):
                    return original(*args, **kwargs)
            except Injected:
                self.fired[name] = self.fired.get(name, 0) + 1
                raise

        return faulty


class EngineStress:
    def __init__(self, family: str, seed: int, rows: int = 3, budget: int = 7, blocks: int = 24,
                 fault_every: tuple[int, int] = (20, 120), shared: bool = False, lookup: int = 0,
                 grouped_steps: bool = False, graph_path: bool = False, snapshot_gap: int = 0,
                 mixed_steps: bool = False):
        self.family, self.seed = family, seed
        # Prefix caching's `prefix_snapshot_gap`: 0 stops every prompt's prefill at its snapshot point (these prompts
        # are far shorter than the default's 256 tokens, which would stop none).
        self.snapshot_gap = snapshot_gap
        self.graph_path = graph_path  # steps a GPU replays from a graph take that path (`steps_routed_as_on_a_gpu`)
        self.graph_steps: list[int] = []  # the lengths of those steps
        self.shared = shared
        self.grouped_steps = grouped_steps  # the loop's schedule (`ContinuousBatchingManager`)
        self.mixed_steps = mixed_steps  # (they run on the graphs' path only: with graph_path)
        self.lookup = lookup  # prompt lookup's drafts per decode step (verified inside the loop), 0: none
        self.bases = random_prompts([18, 25, 12], vocab=90, seed=seed + 7)  # common prefixes (shared=True)
        self.ref, self.ours = family_pair(family)
        self.rng = random.Random(seed)
        self.config = ContinuousBatchingConfig(page_size=4, num_blocks=blocks, max_batch_tokens=budget,
                                               max_requests_per_batch=rows)
        self.faults = Faults(random.Random(seed + 1), fault_every)
        self.submitted: dict[str, tuple[list[int], int, float]] = {}  # prompt, new tokens, repetition penalty
        self.cancelled: set[str] = set()
        self.finals: dict[str, object] = {}
        self.counts = {"finished": 0, "failed_by_fault": 0, "cancelled": 0}

    def run(self, ops: int, timeout: float = 300) -> None:
        rng = self.rng
        self.faults.install()
        try:
            gen = greedy(10, prompt_lookup_num_tokens=self.lookup or None)
            routing = steps_routed_as_on_a_gpu() if self.graph_path else contextlib.nullcontext([])
            with routing as self.graph_steps, self.ours.continuous_batching_context_manager(
                    gen, continuous_batching_config=self.config, grouped_steps=self.grouped_steps,
                    mixed_steps=self.mixed_steps, prefix_snapshot_gap=self.snapshot_gap) as manager:
                for op in range(ops):
                    kind = rng.random()
                    if kind < 0.6:
                        prompt = random_prompts([rng.randint(1, 40)], vocab=90, seed=rng.randrange(10**6))[0] or [5]
                        if self.shared:
                            prompt = self.shared_prompt(prompt)
                        new = rng.randint(1, 10)
                        penalty = PENALTY if rng.random() < 0.2 else 1.0
                        request_id = manager.add_request(prompt, request_id=f"s{op}", max_new_tokens=new,
                                                         sampling=Sampling(repetition_penalty=penalty))
                        self.submitted[request_id] = (prompt, new, penalty)
                    elif kind < 0.75:
                        open_ids = [i for i in self.submitted if i not in self.finals]
                        if open_ids:
                            victim = rng.choice(open_ids)
                            self.cancelled.add(victim)
                            manager.cancel_request(victim)
                    else:
                        self._drain(manager, wait=rng.random() * 0.05)
                deadline = time.time() + timeout
                while len(self.finals) < len(self.submitted):
                    assert time.time() < deadline, f"{len(self.submitted) - len(self.finals)} requests never ended"
                    self._drain(manager, wait=0.5)
                self.cache, self.runner, self.manager = manager.cache, manager.runner, manager
                # What prefix caching did (the manager's exit drops the cached prefixes and their counters).
                self.prefix_stats = manager.cache.memory_stats().get("prefix_cache")
        finally:
            self.faults.remove()
        self._check_end_state()

    def shared_prompt(self, tail: list[int]) -> list[int]:
        """A prompt that continues a common prefix or an earlier request's prompt and answer, cut anywhere."""
        rng = self.rng
        finished = [r for r in self.finals.values() if r.status == RequestStatus.FINISHED]
        if finished and rng.random() < 0.4:
            source = rng.choice(finished)
            base = list(source.prompt_ids) + list(source.generated_tokens)
        else:
            base = rng.choice(self.bases)
        return (base[: rng.randint(len(base) // 2, len(base))] + tail[: rng.randint(1, 8)])[:60]

    def _drain(self, manager, wait: float) -> None:
        while True:
            result = manager.get_result(timeout=wait)
            if result is None:
                return
            wait = 0.0
            assert result.is_finished(), result  # none of these requests streams
            assert result.request_id not in self.finals, f"two final results for {result.request_id}"
            self.finals[result.request_id] = result
            self._check(result)

    def _check(self, result) -> None:
        prompt, new, penalty = self.submitted[result.request_id]
        if result.status == RequestStatus.FINISHED:
            penalized = {"repetition_penalty": penalty} if penalty != 1.0 else {}
            assert result.generated_tokens == alone(self.ref, prompt, new, **penalized), result.request_id
            self.counts["finished"] += 1
        elif result.error == "cancelled":
            assert result.request_id in self.cancelled, result.request_id
            self.counts["cancelled"] += 1
        else:
            assert "injected fault" in (result.error or ""), (result.request_id, result.error)
            self.counts["failed_by_fault"] += 1

    def _check_end_state(self) -> None:
        assert pools_full(self.cache), "blocks still held after every request ended"
        assert not self.runner.encoded and not self.runner.rows
        assert not self.manager.scheduler.rows and not self.manager.scheduler.waiting
        assert not self.manager.scheduler._by_head, "an ended request is still indexed by its prompt's head"
        assert not self.manager._in_flight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen4_exp", choices=["qwen4_exp", "inkling"])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared", action="store_true", help="prompts continue common prefixes (prefix caching)")
    parser.add_argument("--lookup", type=int, default=0, help="prompt lookup drafts per decode step")
    parser.add_argument("--grouped-steps", action="store_true", help="the loop runs grouped steps")
    parser.add_argument("--snapshot-gap", type=int, default=0, help="prefix caching's prefix_snapshot_gap")
    parser.add_argument("--mixed-steps", action="store_true", help="the loop runs mixed steps (with --graph-path)")
    parser.add_argument("--graph-path", action="store_true",
                        help="steps a GPU replays from a CUDA graph take that path (from its static buffers)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    stress = EngineStress(args.family, args.seed, shared=args.shared, lookup=args.lookup,
                          grouped_steps=args.grouped_steps, graph_path=args.graph_path, snapshot_gap=args.snapshot_gap,
                          mixed_steps=args.mixed_steps)
    stress.run(args.ops, timeout=3600)
    print(f"{args.family} seed {args.seed}: {args.ops} operations, {len(stress.submitted)} requests, "
          f"{stress.counts}, faults fired {stress.faults.fired}, {stress.manager.stats}, {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
