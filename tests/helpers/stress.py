"""Model-based stress test of `QSAPagedCache`: a seeded random sequence of operations checked against a
reference that recomputes every row from its token history on a fresh cache.

Operations: a new batch (reset + prefill of rows of very different lengths), decode steps, verify steps
of k + 1 tokens followed by a crop of the rejected ones, continuations of a few tokens, beam reorders,
row repeats and selections, row placement as continuous batching does it (`move_rows`: rows leave, fresh
rows enter and take their first tokens in the next step), resets, and any step with a fault injected at
a random torch call.
After every step the last logits of each row must equal the reference's (the row alone, unpadded, on a
fresh cache), and every block table must account for each block exactly once (free, or held by one
row).

With ``prefix=True`` the cache caches prefixes (``prefix_caching``, small budgets): a new batch first keeps the
rows that stand at a unit boundary as cached prefixes, then takes prompts that continue earlier histories cut
anywhere (inside a block, a QSA group, a window), so rows start from shared blocks and snapshots, and prefills
with faults injected must leave the cached entries as they were. Block accounting then counts shared blocks
(``BlockTable.check_accounting``: free, listed by rows as often as counted, or idle and cached). A failed step must change nothing (the row histories stay), or leave a cache that refuses with
reset() (then it is reset and the batch prefilled again).

CI runs a short sequence (tests/cache/test_stress.py); run a long one with
``python tests/helpers/stress.py --family qwen4_exp --ops 3000 --seed 0``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: `helpers`
from helpers.faults import FailAt, Injected  # noqa: E402

from hf_qsa_cache import QSAPagedCache  # noqa: E402

K = 2  # drafts a verify step carries (the cache's num_speculative_tokens)
ROWS = 4
MAX_LEN = 72


def build_model(family: str):
    if family == "qwen4_exp":
        from helpers.qwen4 import make_pair

        return make_pair(seed=3)[1]
    import helpers.inkling as inkling

    return inkling.make_pair(inkling.make_config(), seed=4)[1]


class Stress:
    def __init__(self, family: str, seed: int, prefix: bool = False, snapshot_gap: int = 0):
        self.model = build_model(family)
        self.vocab = self.model.config.vocab_size
        self.rng = random.Random(seed)
        self.prefix = prefix
        # (``snapshot_gap``: a prefill from cached prefixes stops at a prompt's snapshot point only that far past its
        # restore; 0: always)
        extra = dict(prefix_caching=True, prefix_snapshots=4, prefix_blocks=24,
                     prefix_snapshot_gap=snapshot_gap) if prefix else {}
        self.cache = QSAPagedCache(self.model.config, ROWS, MAX_LEN, block_size=2 if family == "inkling" else 4,
                                   num_speculative_tokens=K, **extra)
        self.past: list[list[int]] = []  # earlier batches' histories: what new prompts continue (prefix=True)
        self.history: list[list[int]] = []
        self.counts: dict[str, int] = {}
        self.checked = 0

    # ------------------------------------------------------------------ the reference
    def reference_last_logits(self, tokens: list[int]) -> torch.Tensor:
        fresh = QSAPagedCache(self.model.config, 1, MAX_LEN, block_size=4)
        return self.model(torch.tensor([tokens]), past_key_values=fresh).logits[0, -1]

    def check(self, logits: torch.Tensor) -> None:
        for b, tokens in enumerate(self.history):
            want = self.reference_last_logits(tokens)
            torch.testing.assert_close(logits[b, -1], want, atol=5e-5, rtol=0,
                                       msg=lambda m: f"row {b} ({len(tokens)} tokens): {m}")
        self.checked += 1

    def check_pools(self) -> None:
        """Every block free, listed by rows (as often as its references say: copied rows share full blocks), or
        idle in the prefix cache; none lost."""
        for table in self.cache.tables.values():
            table.check_accounting()

    # ------------------------------------------------------------------ steps
    def forward(self, new: list[list[int]]) -> torch.Tensor:
        """Every row gets ``new[b]`` (the same count per row); left-padded mask over all columns."""
        cache = self.cache
        width = len(new[0])
        columns = cache.columns_seen
        mask = torch.zeros(len(new), columns + width, dtype=torch.long)
        for b in range(len(new)):
            held = cache.lengths[b] if columns else 0
            mask[b, columns - held:] = 1
        return self.model(torch.tensor(new), attention_mask=mask, past_key_values=cache).logits

    def new_batch(self) -> torch.Tensor:
        if self.prefix:
            self.prefix_batch()
            return self.prefill()
        self.cache.reset()
        rows = self.rng.randint(1, ROWS)
        lengths = [self.rng.choice([1, 2, 3, self.rng.randint(4, 40)]) for _ in range(rows)]
        self.history = [[self.rng.randrange(2, self.vocab) for _ in range(n)] for n in lengths]
        width = max(lengths)
        ids = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, width, dtype=torch.long)
        for b, tokens in enumerate(self.history):
            ids[b, width - len(tokens):] = torch.tensor(tokens)
            mask[b, width - len(tokens):] = 1
        return self.model(ids, attention_mask=mask, past_key_values=self.cache).logits

    def prefix_batch(self) -> None:
        """Rows at a unit boundary become cached prefixes, every row is released, and the new rows' prompts
        continue earlier histories cut anywhere (or are new)."""
        cache, rng = self.cache, self.rng
        if cache._unusable is None:
            for b, tokens in enumerate(self.history):
                if tokens and len(tokens) % cache.prefix_unit == 0 and cache.lengths[b] == len(tokens):
                    cache.cache_prefix(b, tokens)
        self.past = (self.past + [t for t in self.history if t])[-8:]
        cache.reset()
        prompts = []
        for _ in range(rng.randint(1, ROWS)):
            tokens = []
            if self.past and rng.random() < 0.75:
                source = rng.choice(self.past)
                tokens = source[: rng.randint(0, len(source))]
            tokens += [rng.randrange(2, self.vocab) for _ in range(rng.choice([1, 2, rng.randint(3, 30)]))]
            prompts.append(tokens[: MAX_LEN - 12])
        self.history = prompts
        self.count("prefix batch")

    def prefill(self) -> torch.Tensor:
        """The rows' histories as one left-padded prompt (from cached prefixes where the cache has them)."""
        width = max(len(t) for t in self.history)
        ids = torch.zeros(len(self.history), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, tokens in enumerate(self.history):
            ids[b, width - len(tokens):] = torch.tensor(tokens)
            mask[b, width - len(tokens):] = 1
        return self.model(ids, attention_mask=mask, past_key_values=self.cache, logits_to_keep=1).logits

    def entries(self) -> tuple:
        """The cached entries, their snapshots and blocks (what a failed forward must not change)."""
        prefix = self.cache.prefix
        return tuple(sorted((e.serial, id(e.snapshot), tuple(sorted((n, tuple(b)) for n, b in e.blocks.items())))
                            for e in prefix.entries.values()))

    def room(self) -> int:
        return MAX_LEN - max(len(t) for t in self.history) - K - 1

    def step_op(self, kind: str):
        """``(run, land)``: the step, and what it does to the histories once it landed."""
        rows = len(self.history)
        width = {"decode": 1, "verify": K + 1, "continue": self.rng.randint(2, 6)}[kind]
        new = [[self.rng.randrange(2, self.vocab) for _ in range(width)] for _ in range(rows)]

        def land():
            for b in range(rows):
                self.history[b] += new[b]

        return (lambda: self.forward(new)), land

    def run(self, ops: int, fault_rate: float = 0.25) -> None:
        with torch.no_grad():
            self.check(self.new_batch())
            for _ in range(ops):
                self.one_op(fault_rate)
                self.check_pools()

    def one_op(self, fault_rate: float) -> None:
        kind = self.rng.choices(["decode", "verify", "continue", "reorder", "select", "repeat", "move", "batch"],
                                weights=[6, 4, 2, 1, 1, 1, 1, 4 if self.prefix else 1])[0]
        if kind in ("decode", "verify", "continue") and self.room() < 6:
            kind = "batch"
        if kind == "batch" and self.prefix and self.rng.random() < fault_rate:
            self.prefix_batch()
            before = self.entries()
            try:
                with FailAt(self.rng.randint(1, 6000)):
                    logits = self.prefill()
                self.count("prefix batch (fault past its end)")
            except Injected:
                self.count("prefix batch+fault")
                assert self.entries() == before, "a failed prefill changed the cached prefixes"
                assert not any(self.cache.lengths) and self.cache.columns_seen == 0
                self.check_pools()
                logits = self.prefill()
            self.check(logits)
            return
        if kind == "batch":
            self.count("batch")
            self.check(self.new_batch())
            return
        if kind in ("reorder", "select", "repeat", "move"):
            self.rows_op(kind)
            return
        run, land = self.step_op(kind)
        if self.rng.random() < fault_rate:
            try:
                with FailAt(self.rng.randint(1, 4000)):
                    run()
            except Injected:
                self.count(kind + "+fault")
                if self.cache._unusable is not None:  # allowed only where the step cannot be taken back
                    self.count("reset after fault")
                    self.check(self.replay_histories())
                return
            self.count(kind + " (fault past its end)")
            land()
            return
        self.count(kind)
        logits = run()
        land()
        self.check(logits)
        if kind == "verify":
            drop = self.rng.randint(0, K)
            if drop:
                self.cache.crop(-drop)
                for tokens in self.history:
                    del tokens[-drop:]
                self.count("crop")

    def rows_op(self, kind: str) -> None:
        rows = len(self.history)
        if kind == "reorder":
            src = [self.rng.randrange(rows) for _ in range(rows)]
            self.cache.reorder_cache(torch.tensor(src))
        elif kind == "select":
            src = self.rng.sample(range(rows), self.rng.randint(1, rows))
            self.cache.batch_select_indices(torch.tensor(src))
        elif kind == "move":  # continuous batching's row placement: some rows leave, fresh ones enter anywhere
            src = self.rng.sample(range(rows), self.rng.randint(1, rows))
            src += [-1] * self.rng.randint(0, ROWS - len(src))
            self.rng.shuffle(src)
            self.cache.move_rows(src)
        else:
            if 2 * rows > ROWS:
                return
            src = [b for b in range(rows) for _ in range(2)]
            self.cache.batch_repeat_interleave(2)
        self.history = [list(self.history[s]) if s >= 0 else [] for s in src]
        self.count(kind)

    def replay_histories(self) -> torch.Tensor:
        """Reset, then prefill the rows' histories again (after a step that could not be taken back)."""
        self.cache.reset()
        if self.prefix:
            return self.prefill()
        width = max(len(t) for t in self.history)
        ids = torch.zeros(len(self.history), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, tokens in enumerate(self.history):
            ids[b, width - len(tokens):] = torch.tensor(tokens)
            mask[b, width - len(tokens):] = 1
        return self.model(ids, attention_mask=mask, past_key_values=self.cache).logits

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix", action="store_true", help="prefix caching: shared prefixes, eviction")
    parser.add_argument("--snapshot-gap", type=int, default=0, help="with --prefix: the cache's prefix_snapshot_gap")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    stress = Stress(args.family, args.seed, prefix=args.prefix, snapshot_gap=args.snapshot_gap)
    stress.run(args.ops)
    print(f"{args.family} seed {args.seed}: {args.ops} operations, {stress.checked} logit checks, all equal to "
          f"the reference; pools exact after every operation ({time.perf_counter() - start:.0f} s)")
    print("operations:", dict(sorted(stress.counts.items())))


if __name__ == "__main__":
    main()
