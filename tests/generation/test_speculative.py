"""Speculative decoding on QSAPagedCache (CPU, fp32), both families.

* Every drafting mode of transformers' generate() (prompt lookup, an assistant model of ours or of
  transformers, Inkling's MTP layers) gives the tokens of plain greedy generate(), on prompts where some
  drafts are accepted and others rejected (checked, not assumed), with QSA selection active (Qwen4Exp
  prompts of 20+ tokens) and Inkling's sliding windows evicting while drafting.
* crop after a verify step (or after several steps) leaves exactly the state plain decoding of the kept
  tokens reaches: the next logits agree; an assistant of ours drafts what it drafts from scratch.
* A crop deeper than the cache kept, or a passed cache with too little headroom, is refused before
  anything changes; memory_stats reports the rollback headroom.
* Sampling with drafting runs and repeats under the same seed.
* Prompt lookup's draft count adapts (`DraftBudget`): the policy on its own, its wrapping of transformers'
  generator, and generate() verifying far fewer drafts than transformers' fixed count when every draft
  is rejected, and exactly as many forwards when every draft is accepted, with the tokens of plain greedy.
"""

from __future__ import annotations

import random

import pytest
import helpers.inkling as inkling
import torch
from helpers.qwen4 import left_pad, make_pair, random_prompts, tiny_config
from transformers import InklingForCausalLM as UpstreamInkling
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
from transformers.modeling_layers import MtpModel

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache import prompt_lookup
from hf_qsa_cache.speculative import DraftBudget, adapt_prompt_lookup
from modeling import InklingForCausalLM, Qwen4ExpForCausalLM

K = 3  # draft tokens per step


# ----------------------------------------------------------------------------- models
def _truncated(main, cls, config, upstream_cls=None):
    """A 2-layer model of the same family made of the main model's first layers (drafts that sometimes agree)."""
    keep = {k: v for k, v in main.state_dict().items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    models = []
    for c in (cls, upstream_cls):
        if c is None:
            continue
        model = c(config).eval()
        missing, _ = model.load_state_dict(keep, strict=False)
        assert not missing
        model.generation_config.num_assistant_tokens = K
        model.generation_config.num_assistant_tokens_schedule = "constant"
        model.generation_config.assistant_confidence_threshold = 0.0  # always draft K tokens
        models.append(model)
    return models


@pytest.fixture(scope="module")
def qwen():
    import transformers

    _, ours = make_pair()
    small = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"])
    assistant, upstream_assistant = _truncated(ours, Qwen4ExpForCausalLM, small, transformers.Qwen4ExpForCausalLM)
    return ours, assistant, upstream_assistant


@pytest.fixture(scope="module")
def ink():
    _, ours = inkling.make_pair(inkling.make_config())
    small = inkling.make_config(num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"])
    assistant, upstream_assistant = _truncated(ours, InklingForCausalLM, small, UpstreamInkling)
    return ours, assistant, upstream_assistant


@pytest.fixture(scope="module")
def ink_mtp(tmp_path_factory):
    """An Inkling checkpoint with two MTP layers, written by transformers' InklingForCausalLM.save_pretrained.

    A small vocabulary makes random MTP drafts right often enough to see both outcomes.
    """
    config = inkling.make_config(num_mtp_layers=2, vocab_size=8)
    upstream, _ = inkling.make_pair(config, seed=1)
    mtp = MtpModel(upstream, 2)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if not name.startswith(("embed_tokens", "shared_head")) and "norm" not in name:
                p.normal_(0.0, 0.3)
    extra = {f"model.mtp.{k}": v for k, v in mtp.state_dict().items()
             if not k.startswith(("embed_tokens", "shared_head"))}
    path = tmp_path_factory.mktemp("inkling_mtp")
    upstream.save_pretrained(path, state_dict={**upstream.state_dict(), **extra})
    return InklingForCausalLM.from_pretrained(path).eval()


# ----------------------------------------------------------------------------- helpers
class DraftLog:
    """Counts the main model's forwards and the tokens each crop of its cache drops."""

    def __init__(self, monkeypatch, model):
        self.forwards = 0
        self.crops: list[tuple[int, int]] = []  # (id of the cache, tokens dropped)
        crop = QSAPagedCache.crop

        def logged(cache, n):
            self.crops.append((id(cache), -n))
            return crop(cache, n)

        monkeypatch.setattr(QSAPagedCache, "crop", logged)
        self.hook = model.register_forward_pre_hook(lambda *a: setattr(self, "forwards", self.forwards + 1))

    def outcome(self, out, new_tokens):
        """(accepted, rejected) drafts of the main model over a generate() call."""
        self.hook.remove()
        main = id(out.past_key_values)
        rejected = sum(n for c, n in self.crops if c == main)
        return new_tokens - self.forwards, rejected


def _greedy(model, ids, n, **kwargs):
    kwargs = {"pad_token_id": 0, "eos_token_id": None, **kwargs}
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              return_dict_in_generate=True, **kwargs)


def _check_drafting(monkeypatch, model, ids, n, **kwargs):
    plain = _greedy(model, ids, n)
    log = DraftLog(monkeypatch, model)
    out = _greedy(model, ids, n, **kwargs)
    accepted, rejected = log.outcome(out, n)
    assert torch.equal(out.sequences, plain.sequences)
    assert accepted > 0 and rejected > 0, f"want both outcomes: {accepted} accepted, {rejected} rejected"
    return out


# Random models rarely agree with a drafter; these seeds give prompts where some drafts are accepted (the
# tests check that they are, and that others are rejected).
def _qwen_prompt(seed=0):
    """A 12-token passage twice, then 10 more tokens: 34 tokens, QSA selection active."""
    return torch.tensor([random_prompts([12], seed=seed)[0] * 2 + random_prompts([10], seed=seed + 1)[0]])


def _ink_prompt(seed=2):
    row = inkling.make_prompts([9], seed=seed)[0]
    return torch.cat([row, row, row[:4]])[None]  # 22 tokens, far past the window of 6


def _ink_lookup_prompt(model, seed=5):
    """A passage, its first 8 greedy tokens, the passage again: the window then sees what it saw before."""
    row = inkling.make_prompts([9], seed=seed)[0]
    continuation = _greedy(model, row[None], 8).sequences[0, len(row):]
    return torch.cat([row, continuation, row])[None]


# ----------------------------------------------------------------------------- greedy equality, every mode
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_prompt_lookup_matches_plain_greedy(family, qwen, ink, monkeypatch):
    model = (qwen if family == "qwen4_exp" else ink)[0]
    ids = _qwen_prompt(seed=5) if family == "qwen4_exp" else _ink_lookup_prompt(model)
    out = _check_drafting(monkeypatch, model, ids, 20, prompt_lookup_num_tokens=K)
    # The cache generate() built can take back what one verify step drafts, and a little more room.
    assert out.past_key_values.num_speculative_tokens == K


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
@pytest.mark.parametrize("which", ["ours", "upstream"])
def test_assistant_model_matches_plain_greedy(family, which, qwen, ink, monkeypatch):
    model, assistant, upstream_assistant = qwen if family == "qwen4_exp" else ink
    ids = _qwen_prompt() if family == "qwen4_exp" else _ink_prompt()
    _check_drafting(monkeypatch, model, ids, 16, assistant_model=assistant if which == "ours" else upstream_assistant)


def test_mtp_matches_plain_greedy(ink_mtp, monkeypatch):
    ids = torch.randint(3, 8, (1, 14), generator=torch.Generator().manual_seed(3))
    out = _check_drafting(monkeypatch, ink_mtp, ids, 20, use_mtp=True)
    assert out.past_key_values.num_speculative_tokens == 2  # one draft per MTP layer


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_our_assistant_drafts_what_it_drafts_from_scratch(family, qwen, ink, monkeypatch):
    """The assistant's own cache is cropped every round (across several of its steps): its drafts must be
    exactly those of a fresh greedy run on the same tokens."""
    model, assistant, _ = qwen if family == "qwen4_exp" else ink
    ids = _qwen_prompt() if family == "qwen4_exp" else _ink_prompt()
    rounds = []
    generate = type(assistant).generate

    def checked(**kwargs):
        out = generate(assistant, **kwargs)
        given = kwargs["input_ids"]
        drafts = out.sequences[:, given.shape[1]:]
        fresh = generate(assistant, given, attention_mask=torch.ones_like(given), max_new_tokens=drafts.shape[1],
                         do_sample=False, pad_token_id=0, eos_token_id=None)
        rounds.append((drafts, fresh[:, given.shape[1]:]))
        return out

    monkeypatch.setattr(assistant, "generate", checked)
    _greedy(model, ids, 12, assistant_model=assistant)
    assert len(rounds) > 3
    for drafts, fresh in rounds:
        assert torch.equal(drafts, fresh)


def test_assistant_treats_a_generated_pad_id_as_a_token(ink):
    """generate() drops the main model's all-ones mask; the assistant must not infer one from pad ids (a generated
    token equal to pad_token_id would look like padding in the middle of the row)."""
    model, assistant, _ = ink
    ids = _ink_prompt()
    plain = _greedy(model, ids, 12).sequences[0, ids.shape[1]:]
    pad = next(t for t in plain.tolist() if t not in ids[0].tolist())
    out = _greedy(model, ids, 12, assistant_model=assistant, pad_token_id=pad)
    assert out.sequences[0, ids.shape[1]:].tolist() == plain.tolist()


# ----------------------------------------------------------------------------- crop exactness
def _family(family, qwen, ink):
    if family == "qwen4_exp":
        ids, mask = left_pad(random_prompts([22, 17], seed=3))
        return qwen[0], ids, mask, 96
    ids, mask = inkling.left_pad(inkling.make_prompts([11, 7], seed=3))
    return ink[0], ids, mask, 128


def _run(model, cache, ids, mask, chunks, crop=0):
    """Prompt, then each chunk of tokens as one forward, then crop; returns the (extended) mask."""
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        for chunk in chunks:
            mask = torch.cat([mask, torch.ones_like(chunk)], dim=1)
            model(chunk, attention_mask=mask, past_key_values=cache)
    cache.crop(-crop)
    return mask[:, : mask.shape[1] - crop]


def _next_logits(model, cache, mask, token):
    mask = torch.cat([mask, torch.ones_like(token)], dim=1)
    with torch.no_grad():
        return model(token, attention_mask=mask, past_key_values=cache).logits[:, -1]


def test_a_crop_builds_its_ring_indices_once_for_every_layer(qwen, monkeypatch):
    """Every GatedDeltaNet / PLE store of a device reads the same ring rows: a crop builds those index
    tensors (host-to-device copies) once, not once per layer."""
    from hf_qsa_cache.stores.linear_state import LinearAttentionState

    model, ids, mask, vocab = _family("qwen4_exp", qwen, None)
    cache = QSAPagedCache(model.config, max_batch_size=2, max_cache_len=64, block_size=4, num_speculative_tokens=K)
    plans = []
    real = LinearAttentionState.restore_plan
    monkeypatch.setattr(LinearAttentionState, "restore_plan", lambda self, *a: plans.append(1) or real(self, *a))
    _run(model, cache, ids, mask, [torch.randint(2, vocab, (2, K + 1))], crop=2)
    stores = sum(layer.stores.get("linear") is not None for layer in cache.layers)
    assert stores > 1 and plans == [1]


# (forwards after the prompt as lengths, tokens to crop): one verify step rejecting some or all of its
# drafts, a crop reaching back across several decode steps, two crops in a row.
SCENARIOS = [([K + 1], 2), ([K + 1], K), ([1, 1, 1], K), ([2, 1], 2), ([K + 1, "crop1"], 1)]


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
@pytest.mark.parametrize("steps, drop", SCENARIOS)
def test_crop_restores_the_state_plain_decoding_reaches(family, steps, drop, qwen, ink):
    model, ids, mask, vocab = _family(family, qwen, ink)
    gen = torch.Generator().manual_seed(5)
    lengths = [s for s in steps if s != "crop1"]
    tokens = torch.randint(2, vocab, (2, sum(lengths) + 1), generator=gen)
    chunks = list(torch.split(tokens[:, :-1], lengths, dim=1))
    cache = QSAPagedCache(model.config, max_batch_size=2, max_cache_len=64, block_size=4, num_speculative_tokens=K)
    if "crop1" in steps:  # crop one, then crop again: both come out of the same kept history
        kept_mask = _run(model, cache, ids, mask, chunks, crop=1)
        cache.crop(-drop)
        kept_mask = kept_mask[:, :-drop]
        drop += 1
    else:
        kept_mask = _run(model, cache, ids, mask, chunks, crop=drop)
    kept = tokens[:, : sum(lengths) - drop]
    nxt = tokens[:, -1:]
    got = _next_logits(model, cache, kept_mask, nxt)

    plain = QSAPagedCache(model.config, max_batch_size=2, max_cache_len=64, block_size=4)
    steps_kept = [kept[:, i: i + 1] for i in range(kept.shape[1])]  # plain decode, one token a step
    want = _next_logits(model, plain, _run(model, plain, ids, mask, steps_kept), nxt)
    assert got.std() > 0.5
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_history_slots_are_computed_once_per_step(qwen, monkeypatch):
    """Every GatedDeltaNet / PLE layer records its rollback history at the same ring slots: one computation
    per step, whatever the depth (and per step, not once for all: a later step has other positions)."""
    from hf_qsa_cache.stores.linear_state import LinearAttentionState

    model, ids, mask, vocab = _family("qwen4_exp", qwen, None)
    calls = []
    real = LinearAttentionState.history_slots
    monkeypatch.setattr(LinearAttentionState, "history_slots", lambda self, *a: calls.append(1) or real(self, *a))
    cache = QSAPagedCache(model.config, max_batch_size=2, max_cache_len=64, block_size=4, num_speculative_tokens=K)
    tokens = torch.randint(2, vocab, (2, 3), generator=torch.Generator().manual_seed(6))
    _run(model, cache, ids, mask, [tokens[:, :1], tokens[:, 1:]])
    assert sum(t == "linear_attention" for t in model.config.layer_types) > 1
    assert len(calls) == 3  # the prefill and two steps


def test_crop_deeper_than_kept_is_refused(qwen):
    model = qwen[0]
    ids, mask = left_pad(random_prompts([22, 17], seed=3))
    cache = QSAPagedCache(model.config, max_batch_size=2, max_cache_len=64, num_speculative_tokens=2)
    tokens = torch.randint(2, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    kept_mask = _run(model, cache, ids, mask, [tokens[:, :3]])
    before = (list(cache.lengths), cache.columns_seen)
    refused = r"cannot drop 3 tokens: row 0 can go back 2 at most \(num_speculative_tokens=2"
    with pytest.raises(ValueError, match=refused):
        cache.crop(-3)
    assert (list(cache.lengths), cache.columns_seen) == before
    cache.crop(-1)
    with pytest.raises(ValueError, match=r"cannot drop 2 tokens: row 0 can go back 1 at most"):
        cache.crop(-2)  # crops in a row share one budget
    # The refused crops changed nothing: the cache holds the prompt and the first two tokens.
    got = _next_logits(model, cache, kept_mask[:, :-1], tokens[:, 3:4])
    plain = QSAPagedCache(model.config, max_batch_size=2, max_cache_len=64)
    want = _next_logits(model, plain, _run(model, plain, ids, mask, [tokens[:, :1], tokens[:, 1:2]]), tokens[:, 3:4])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

    no_history = QSAPagedCache(model.config, max_batch_size=2, max_cache_len=64)
    _run(model, no_history, ids, mask, [tokens[:, :2]])
    with pytest.raises(ValueError, match=r"no rollback history .*num_speculative_tokens=0.*num_speculative_tokens=1"):
        no_history.crop(-1)


def test_memory_stats_report_rollback_headroom(qwen):
    model = qwen[0]
    ids, mask = left_pad(random_prompts([22, 17], seed=3))
    with_headroom = QSAPagedCache(model.config, max_batch_size=2, max_cache_len=64, num_speculative_tokens=K)
    without = QSAPagedCache(model.config, max_batch_size=2, max_cache_len=64)
    for cache in (with_headroom, without):
        _run(model, cache, ids, mask, [])
    c = model.config
    linear_layers = c.layer_types.count("linear_attention")
    # At least the recurrent states: fp32 [rows + 1 (pads), K + 1 positions, value heads, key dim, value dim].
    per_position = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    recurrent = linear_layers * 3 * (K + 1) * per_position
    stats = with_headroom.memory_stats()["bytes"]
    assert stats["rollback_headroom"] >= recurrent
    assert "rollback_headroom" not in without.memory_stats()["bytes"]
    assert with_headroom.memory_stats()["total_bytes"] > without.memory_stats()["total_bytes"]


# ----------------------------------------------------------------------------- caches passed by the user
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_passed_cache_without_headroom_is_refused_before_prefill(family, qwen, ink):
    model, assistant, _ = qwen if family == "qwen4_exp" else ink
    ids = _qwen_prompt() if family == "qwen4_exp" else _ink_prompt()
    for kwargs in (dict(prompt_lookup_num_tokens=K), dict(assistant_model=assistant)):
        cache = QSAPagedCache(model.config, max_batch_size=1, max_cache_len=64, num_speculative_tokens=K - 1)
        with pytest.raises(ValueError, match=rf"num_speculative_tokens={K - 1}: build .*num_speculative_tokens={K}"):
            _greedy(model, ids, 8, past_key_values=cache, **kwargs)
        assert cache.columns_seen == 0 and not cache.is_initialized
    # Enough headroom: the passed cache is used as is.
    cache = QSAPagedCache(model.config, max_batch_size=1, max_cache_len=64, num_speculative_tokens=K)
    out = _greedy(model, ids, 8, past_key_values=cache, prompt_lookup_num_tokens=K)
    assert out.past_key_values is cache
    assert torch.equal(out.sequences, _greedy(model, ids, 8).sequences)


@pytest.mark.parametrize("new_tokens", [6, 40])
def test_heuristic_schedule_is_capped_at_twice_its_start(qwen, new_tokens, monkeypatch):
    """transformers grows a heuristic draft count by 2 after every fully accepted round, without bound;
    generate() caps it at twice the assistant's num_assistant_tokens and sizes the rollback headroom by
    that (or by max_new_tokens - 1 when smaller). The assistant here is the model itself: every draft is
    accepted, so the count would grow every round."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    model, _, _ = qwen
    ids = _qwen_prompt()
    assistant = Qwen4ExpForCausalLM(model.config).eval()
    assistant.load_state_dict(model.state_dict())
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    drafted = []
    get_candidates = AssistedCandidateGenerator.get_candidates

    def recording(self, *args, **kwargs):
        drafted.append(self.num_assistant_tokens)
        return get_candidates(self, *args, **kwargs)

    monkeypatch.setattr(AssistedCandidateGenerator, "get_candidates", recording)
    out = _greedy(model, ids, new_tokens, assistant_model=assistant)
    assert out.past_key_values.num_speculative_tokens == min(4, new_tokens - 1)
    assert max(drafted) == 4 and (new_tokens < 20 or drafted.count(4) > 2), drafted
    assert torch.equal(out.sequences, _greedy(model, ids, new_tokens).sequences)


# ----------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_sampling_with_drafting_repeats_under_a_seed(family, qwen, ink):
    model, assistant, _ = qwen if family == "qwen4_exp" else ink
    ids = _qwen_prompt() if family == "qwen4_exp" else _ink_prompt()

    def sample(seed, **kwargs):
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(seed)
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=True,
                                  top_k=0, pad_token_id=0, eos_token_id=None, **kwargs)

    for kwargs in (dict(prompt_lookup_num_tokens=K), dict(assistant_model=assistant)):
        first, again, other = sample(0, **kwargs), sample(0, **kwargs), sample(1, **kwargs)
        assert first.shape == (1, ids.shape[1] + 10)
        assert torch.equal(first, again)
        assert not torch.equal(first, other)


# ----------------------------------------------------------------------------- adaptive prompt lookup
def _rounds(budget, outcome, n):
    """``n`` rounds: propose, then observe ``outcome(proposed)`` accepted drafts. Returns the proposals."""
    proposals = []
    for _ in range(n):
        proposed = budget.propose()
        proposals.append(proposed)
        budget.observe(proposed, outcome(proposed))
    return proposals


def test_draft_budget_backs_off_when_every_draft_is_rejected():
    budget = DraftBudget(4, max_pause=8)
    proposals = _rounds(budget, lambda p: 0, 40)
    # 4 drafts, halved to 2 and 1; the rounds between two tries double (1, 2, 4, 8) and stop growing at 8.
    assert proposals[:11] == [4, 0, 2, 0, 0, 1, 0, 0, 0, 0, 1]
    tries = [i for i, p in enumerate(proposals) if p]
    assert [b - a - 1 for a, b in zip(tries, tries[1:])] == [1, 2, 4, 8, 8, 8]
    assert budget.pause == 8 and budget.tokens == 1


def test_draft_budget_stays_at_its_limit_while_drafts_are_accepted():
    budget = DraftBudget(5)
    assert _rounds(budget, lambda p: p, 30) == [5] * 30
    # A round that finds no match (proposes nothing) tells nothing: the budget stays.
    budget.observe(0, 0)
    assert budget.propose() == 5


def test_draft_budget_mixed_rounds():
    budget = DraftBudget(6, max_pause=16)
    assert _rounds(budget, lambda p: 0, 8) == [6, 0, 3, 0, 0, 1, 0, 0]  # backed off: tokens 1, pause 8
    assert budget.pause == 8
    # Accepted again: +2 a fully accepted round up to the limit, and the back-off starts over at 1 round.
    assert _rounds(budget, lambda p: p, 6) == [0, 0, 1, 3, 5, 6]
    assert budget.pause == 1
    # Some accepted, some rejected: one draft less a round, at least one; the back-off stays at 1.
    assert _rounds(budget, lambda p: p - 1, 5) == [6, 5, 4, 3, 2]
    assert budget.pause == 1 and budget.tokens == 1
    assert _rounds(budget, lambda p: 0, 3) == [1, 0, 1]  # the first all-rejected round pauses 1 round
    # An accepted count above the proposal (transformers never reports one) is read as all accepted.
    budget = DraftBudget(3)
    budget.observe(2, 9)
    assert budget.propose() == 3


def test_draft_budget_never_exceeds_its_limit():
    rng = random.Random(0)
    for limit in (1, 2, 3, 7):
        budget = DraftBudget(limit)
        proposals = _rounds(budget, lambda p: rng.randint(0, p), 500)
        assert max(proposals) == limit and min(proposals) == 0
        assert all(0 <= p <= limit for p in proposals)
    with pytest.raises(ValueError, match="limit >= 1"):
        DraftBudget(0)


def test_adapt_prompt_lookup_sets_the_count_and_skips_the_lookup_when_paused(monkeypatch):
    """The wrapper around transformers' generator: the budget sets num_output_tokens; a paused round returns
    the input as transformers does without a match, and never runs the lookup."""
    generator = PromptLookupCandidateGenerator(num_output_tokens=3, max_length=64)
    lookups = []
    lookup = prompt_lookup.lookup_drafts

    def counted(tokens, num_drafts, *args):
        lookups.append(num_drafts)
        return lookup(tokens, num_drafts, *args)

    monkeypatch.setattr(prompt_lookup, "lookup_drafts", counted)
    adapt_prompt_lookup(generator, DraftBudget(3))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6]])

    def round_(accepted):
        candidates, logits = generator.get_candidates(ids)
        generator.update_candidate_strategy(candidates, None, accepted)
        return candidates[0, ids.shape[1]:].tolist()

    assert round_(0) == [7, 8, 9]  # all rejected: 1 round paused, then 1 draft
    assert round_(0) == []
    assert round_(1) == [7]
    assert round_(1) == [7, 8, 9]  # fully accepted: +2
    assert lookups == [3, 1, 3] and generator.draft_budget.pause == 1
    # What counts is what the forward verified (transformers' logits: one position per draft, plus one),
    # also when a wrapper around this one cut the drafts: 1 verified and accepted is a fully accepted round.
    generator.get_candidates(ids)
    generator.update_candidate_strategy(ids, torch.zeros(1, 2, 16), 1)
    assert generator.draft_budget.propose() == 3


class ForceTokens(LogitsProcessor):
    """Allows only ``stream[i]`` at the i-th position after a prompt of ``start`` tokens."""

    def __init__(self, stream, start):
        self.stream, self.start = stream, start

    def __call__(self, input_ids, scores):
        token = self.stream[input_ids.shape[1] - self.start]
        return torch.full_like(scores, float("-inf")).index_fill_(1, token.view(1), 0.0)


class FedTokens:
    """Tokens each forward of the main model receives (the first: the prompt, plus drafts when drafting)."""

    def __init__(self, model):
        self.lengths: list[int] = []
        self.hook = model.register_forward_pre_hook(
            lambda m, args, kwargs: self.lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)

    def drafts(self, prompt_len):
        """Draft tokens verified: every forward verifies one token besides its drafts."""
        self.hook.remove()
        return sum(self.lengths) - prompt_len - len(self.lengths)


def _passage(vocab, length, seed):
    return torch.randperm(vocab - 2, generator=torch.Generator().manual_seed(seed))[:length] + 2


def _lookup_runs(model, ids, n, monkeypatch, **kwargs):
    """(plain, fixed, adaptive): each (tokens, forwards, verified drafts) of a greedy generate()."""
    runs = [_greedy(model, ids, n, **kwargs).sequences]
    for adaptive in (False, True):
        monkeypatch.setattr(model, "adaptive_prompt_lookup", adaptive)
        fed = FedTokens(model)
        tokens = _greedy(model, ids, n, prompt_lookup_num_tokens=K, **kwargs).sequences
        runs.append((tokens, len(fed.lengths), fed.drafts(ids.shape[1])))
    return runs


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_adaptive_prompt_lookup_verifies_few_drafts_when_all_are_rejected(family, qwen, ink, monkeypatch):
    """A passage of distinct tokens twice: lookup keeps finding n-grams of it (and of the generated text)
    whose continuations the random model does not follow. transformers' fixed count verifies K drafts
    every round that finds a match; the adaptive one backs off after the first rejections."""
    model = (qwen if family == "qwen4_exp" else ink)[0]
    passage = _passage(model.config.vocab_size, 40, seed=0)
    ids = torch.cat([passage, passage])[None]
    n = 24
    plain, (fixed, fixed_forwards, fixed_drafts), (adaptive, forwards, drafts) = _lookup_runs(
        model, ids, n, monkeypatch)
    assert torch.equal(fixed, plain) and torch.equal(adaptive, plain)
    # Every draft rejected (checked, not assumed): one forward per token either way.
    assert fixed_forwards == forwards == n
    assert fixed_drafts >= 20
    # The first round's K drafts, then a single draft after pauses of 1, 2, 4, 8 rounds (a round that
    # finds no match does not count as a try).
    assert drafts <= K + 5 and drafts * 3 <= fixed_drafts, (drafts, fixed_drafts)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_adaptive_prompt_lookup_keeps_every_accepted_draft(family, qwen, ink, monkeypatch):
    """The text is forced to continue the passage the prompt repeats: every draft is accepted, and the
    adaptive count verifies exactly what transformers' fixed count does, in as few forwards."""
    model = (qwen if family == "qwen4_exp" else ink)[0]
    passage = _passage(model.config.vocab_size, 40, seed=1)
    ids = torch.cat([passage, passage[:8]])[None]
    n = 20
    force = LogitsProcessorList([ForceTokens(passage[8:], ids.shape[1])])
    plain, (fixed, fixed_forwards, fixed_drafts), (adaptive, forwards, drafts) = _lookup_runs(
        model, ids, n, monkeypatch, logits_processor=force)
    assert torch.equal(plain[0, ids.shape[1]:], passage[8:8 + n])
    assert torch.equal(fixed, plain) and torch.equal(adaptive, plain)
    assert forwards == fixed_forwards == -(-n // (K + 1)) and drafts == fixed_drafts


def test_prompt_lookup_batch_is_one_row(qwen):
    """transformers 5.23 runs assisted generation (prompt lookup included) on one row only; a DraftBudget
    per generate() call is that row's."""
    model = qwen[0]
    ids = torch.cat([_passage(96, 12, seed=2)] * 2)[None].repeat(2, 1)
    with pytest.raises(ValueError, match="only supported for batch_size = 1"):
        _greedy(model, ids, 4, prompt_lookup_num_tokens=K)
