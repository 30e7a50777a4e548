"""Qwen4ExpForConditionalGeneration (images, video) on the paged cache against transformers' own class.

The checkpoint is written by transformers' class and loaded by ours with `from_pretrained`. Each row of a
left-padded ragged batch carries its own media (two images of different grids; a video and an image; none),
and must give the greedy tokens upstream gives on that row alone, logits within 2e-4 (fp32). QSA selection
is active (prompts of 40-60 tokens, budget 8 tokens in groups of 2).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.qwen4 import collect_results, randomize_, tiny_config
from transformers import Qwen4ExpConfig
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig

from hf_qsa_cache import QSAPagedCache
from modeling import Qwen4ExpForConditionalGeneration

IMAGE, VIDEO, START, END = 90, 91, 92, 93
PATCH_FEATURES = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch
NEW_TOKENS = 8


def mm_config() -> Qwen4ExpConfig:
    vision = Qwen4ExpVisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
                                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                                  num_position_embeddings=16, in_channels=3)
    return Qwen4ExpConfig(text_config=tiny_config().to_dict(), vision_config=vision.to_dict(), image_token_id=IMAGE,
                          video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    ref = transformers.Qwen4ExpForConditionalGeneration(mm_config()).eval()
    randomize_(ref, 0)
    path = tmp_path_factory.mktemp("qwen4_exp_mm")
    ref.save_pretrained(path)
    ours = Qwen4ExpForConditionalGeneration.from_pretrained(path).eval()
    return ref, ours, path


class Row:
    """One request: text around media spans. ``parts``: ints (text lengths), ("image", h, w) or ("video", t, h, w)
    (patch grids; a video's frames are separated by a text token, as the processor's timestamps do)."""

    def __init__(self, parts, seed):
        gen = torch.Generator().manual_seed(seed)
        text = lambda n: torch.randint(2, 88, (n,), generator=gen).tolist()  # noqa: E731
        self.ids, self.images, self.image_grids, self.videos, self.video_grids = [], [], [], [], []
        for part in parts:
            if isinstance(part, int):
                self.ids += text(part)
            elif isinstance(part, list):  # explicit ids
                self.ids += part
            elif part[0] == "image":
                _, h, w = part
                self.ids += [START] + [IMAGE] * (h * w // 4) + [END]
                self.images.append(torch.randn(h * w, PATCH_FEATURES, generator=gen))
                self.image_grids.append([1, h, w])
            else:
                _, t, h, w = part
                for frame in range(t):
                    self.ids += text(1) + [START] + [VIDEO] * (h * w // 4) + [END]
                self.videos.append(torch.randn(t * h * w, PATCH_FEATURES, generator=gen))
                self.video_grids.append([t, h, w])


ROWS = [
    Row([18, ("image", 4, 6), 3, ("image", 2, 4), 9], seed=1),
    Row([5, ("video", 2, 4, 4), 4, ("image", 6, 4), 21], seed=2),
    Row([37], seed=3),
]


def media(rows) -> dict:
    out = {}
    images = [x for r in rows for x in r.images]
    videos = [x for r in rows for x in r.videos]
    if images:
        out.update(pixel_values=torch.cat(images), image_grid_thw=torch.tensor([g for r in rows for g in r.image_grids]))
    if videos:
        out.update(pixel_values_videos=torch.cat(videos),
                   video_grid_thw=torch.tensor([g for r in rows for g in r.video_grids]))
    return out


def batch(rows, right_pad: bool = False):
    width = max(len(r.ids) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        cols = slice(0, len(r.ids)) if right_pad else slice(width - len(r.ids), width)
        ids[i, cols] = torch.tensor(r.ids)
        mask[i, cols] = 1
    mm = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    return dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=mm, **media(rows))


GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def upstream_alone(models):
    """Upstream's greedy tokens and logits ``[new, vocab]`` for each row alone (unpadded)."""
    ref = models[0]
    out = []
    for r in ROWS:
        with torch.no_grad():
            res = ref.generate(**batch([r]), **GREEDY)
        out.append((res.sequences[0, len(r.ids):].tolist(), torch.stack(res.logits, 1)[0]))
    return out


def check_rows(result, width, upstream_alone, tol=2e-4):
    logits = torch.stack(result.logits, 1)
    for i, (tokens, ref_logits) in enumerate(upstream_alone):
        assert result.sequences[i, width:].tolist() == tokens, f"row {i}"
        assert (logits[i] - ref_logits).abs().max().item() < tol, f"row {i}"


@pytest.mark.parametrize("how", ["default cache", "explicit cache", "chunked prefill", "right padded"])
def test_ragged_batch_with_media_matches_each_row_alone(models, upstream_alone, how, monkeypatch):
    _, ours, _ = models
    inputs = batch(ROWS, right_pad=how == "right padded")
    width = inputs["input_ids"].shape[1]
    kwargs = dict(GREEDY)
    if how == "explicit cache":
        kwargs["past_key_values"] = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=width + NEW_TOKENS,
                                                  block_size=4)
    elif how == "chunked prefill":
        # 3 rows x 7 columns per chunk: chunk ends fall inside image and video spans and inside QSA groups.
        monkeypatch.setattr(ours, "prefill_chunk_tokens", 21)
    with torch.no_grad():
        result = ours.generate(**inputs, **kwargs)
    check_rows(result, width, upstream_alone)


def test_prompt_lookup_with_media(models, upstream_alone):
    """Assisted decoding (transformers allows one row): drafts verified and rolled back over a media prompt."""
    _, ours, _ = models
    for r, (tokens, ref_logits) in zip(ROWS, upstream_alone):
        with torch.no_grad():
            result = ours.generate(**batch([r]), prompt_lookup_num_tokens=3, **GREEDY)
        assert result.sequences[0, len(r.ids):].tolist() == tokens
        assert (torch.stack(result.logits, 1)[0] - ref_logits).abs().max().item() < 2e-4


@pytest.mark.parametrize("loop", ["prompt lookup", "plain greedy"])
def test_greedy_with_media_in_our_loop(models, upstream_alone, loop, monkeypatch):
    """Without per-step logits asked for, one row of greedy decoding takes our loops (`lookup_decoding`, `decode_loop`),
    with prompt lookup or without: upstream's tokens over a media prompt (the media in the first forward only,
    positions from each row's rope delta, drafts rolled back)."""
    from hf_qsa_cache import decode_loop, lookup_decoding

    module, name, extra = {
        "prompt lookup": (lookup_decoding, "decode_with_prompt_lookup", {"prompt_lookup_num_tokens": 3}),
        "plain greedy": (decode_loop, "decode", {})}[loop]
    _, ours, _ = models
    ran = []
    decode = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: ran.append(1) or decode(*a, **k))
    for r, (tokens, _) in zip(ROWS, upstream_alone):
        ran.clear()
        with torch.no_grad():
            result = ours.generate(**batch([r]), **extra, **{**GREEDY, "output_logits": False})
        assert ran and result.sequences[0, len(r.ids):].tolist() == tokens


def test_prompt_lookup_never_drafts_a_placeholder_into_the_media_forward(models):
    """The prompt ends with the two tokens before its image: lookup copies the image's start and placeholders as the
    first round's drafts, verified in the forward that carries the media (upstream fails there: more placeholders
    than features). Ours cuts that round's drafts at the first placeholder; tokens stay upstream's greedy ones."""
    ref, ours, _ = models
    row = Row([5, [40, 41], ("image", 4, 4), 6, [40, 41]], seed=11)
    with torch.no_grad():
        expected = ref.generate(**batch([row]), **GREEDY)
        result = ours.generate(**batch([row]), prompt_lookup_num_tokens=4, **GREEDY)
    assert result.sequences.tolist() == expected.sequences.tolist()
    assert (torch.stack(result.logits, 1) - torch.stack(expected.logits, 1)).abs().max().item() < 2e-4


def test_manual_decode_continues_each_row_at_its_rope_delta(models, upstream_alone):
    """A prefill with media and then steps without position ids: each row's next positions come from the cache's
    per-row delta (an image shortens a row's positions, text-only rows have none), also after rows are reordered."""
    _, ours, _ = models
    inputs = batch(ROWS)
    cache = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=80)
    with torch.no_grad():
        out = ours(**inputs, past_key_values=cache, logits_to_keep=1)
    assert cache.rope_deltas[:3] != [0, 0, 0] and cache.rope_deltas[2] == 0
    order = [2, 0, 1]  # reorder rows (beam search does this): each row's delta moves with it
    cache.reorder_cache(torch.tensor(order))
    mask = inputs["attention_mask"][order]
    token = out.logits[order, -1].argmax(-1, keepdim=True)
    for step in range(NEW_TOKENS):
        for i, row in enumerate(order):
            tokens, ref_logits = upstream_alone[row]
            assert token[i, 0].item() == tokens[step]
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        with torch.no_grad():
            out = ours(input_ids=token, attention_mask=mask, past_key_values=cache)
        if step + 1 < NEW_TOKENS:
            for i, row in enumerate(order):
                assert (out.logits[i, -1] - upstream_alone[row][1][step + 1]).abs().max().item() < 2e-4
        token = out.logits[:, -1].argmax(-1, keepdim=True)


def test_recorded_decode_steps_continue_each_row_at_its_rope_delta(models, upstream_alone):
    """Decode steps that a GPU replays from a recorded graph fill the graph's position buffer from each row's length
    and delta on the host (`DecodeGraphs._fill`): after a media prefill their logits are upstream's, the first step
    (which records) and the replays alike."""
    from helpers.graphs import ReplayingGraphs

    _, ours, _ = models
    inputs = batch(ROWS)
    cache = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=80)
    runner = ReplayingGraphs(ours, cache, "cpu", record=True)
    with torch.no_grad():
        out = ours(**inputs, past_key_values=cache, logits_to_keep=1)
        assert cache.rope_deltas[:3] != [0, 0, 0]
        mask, token = inputs["attention_mask"], out.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(1, 4):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits = runner.step(token, None, mask)
            for row, (_, ref_logits) in enumerate(upstream_alone):
                assert (logits[row, -1] - ref_logits[step]).abs().max().item() < 2e-4
            token = logits[:, -1].argmax(-1, keepdim=True)
    assert (runner.recordings, runner.replays) == (1, 2)


def test_media_in_a_later_turn(models):
    """Rows that hold tokens take new media: their 3-D positions continue at each row's position (length plus
    delta), as upstream numbers the whole conversation in one forward."""
    ref, ours, _ = models
    turns = [(ROWS[0], Row([4, ("image", 2, 4), 6], seed=5)), (ROWS[2], Row([3, ("image", 4, 4), 5], seed=6))]
    cache = QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=120)
    first, second = batch([t[0] for t in turns]), batch([t[1] for t in turns])
    with torch.no_grad():
        ours(**first, past_key_values=cache, logits_to_keep=1)
        second["attention_mask"] = torch.cat([first["attention_mask"], second["attention_mask"]], 1)
        out = ours(**second, past_key_values=cache, logits_to_keep=1)
        follow = out.logits[:, -1].argmax(-1, keepdim=True)  # and one step after it, without position ids
        step = ours(input_ids=follow, past_key_values=cache,
                    attention_mask=torch.cat([second["attention_mask"], torch.ones_like(follow)], 1))
        for i, (a, b) in enumerate(turns):
            whole = Row([], seed=0)
            for part in (a, b):
                for name in ("ids", "images", "image_grids", "videos", "video_grids"):
                    getattr(whole, name).extend(getattr(part, name))
            inputs = batch([whole])
            inputs["input_ids"] = torch.cat([inputs["input_ids"], follow[i:i + 1]], 1)
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
            inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.int)], 1)
            expected = ref(**inputs).logits[0]
            assert (out.logits[i, -1] - expected[-2]).abs().max().item() < 2e-4
            assert (step.logits[i, -1] - expected[-1]).abs().max().item() < 2e-4


def test_second_generate_continues_after_media(models):
    """generate() continuing a cache it was given picks each row's delta up from the cache (upstream keeps one on
    the model): the continuation equals one longer call."""
    ref, ours, _ = models
    inputs = batch(ROWS[:2])
    width = inputs["input_ids"].shape[1]
    cache = QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=width + 2 * NEW_TOKENS)
    with torch.no_grad():
        first = ours.generate(**inputs, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, NEW_TOKENS, dtype=torch.long)], 1)
        mm = torch.cat([inputs["mm_token_type_ids"], torch.zeros(2, NEW_TOKENS, dtype=torch.int)], 1)
        second = ours.generate(input_ids=first, attention_mask=mask, mm_token_type_ids=mm, past_key_values=cache,
                               max_new_tokens=NEW_TOKENS, do_sample=False)
        whole = ours.generate(**inputs, max_new_tokens=2 * NEW_TOKENS, do_sample=False)
    assert torch.equal(second, whole)


def test_media_without_token_types_is_refused_before_the_cache_changes(models):
    _, ours, _ = models
    inputs = batch(ROWS[:1])
    del inputs["mm_token_type_ids"]
    cache = QSAPagedCache(ours.config, max_batch_size=1, max_cache_len=80)
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        ours(**inputs, past_key_values=cache)
    assert cache.get_seq_length() == 0 and cache.rope_deltas[0] == 0


def test_a_failed_media_step_leaves_the_rows_deltas(models, monkeypatch):
    """The delta is set inside the step's transaction: a fault in a layer takes it back with everything else."""
    _, ours, _ = models
    cache = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=80)
    with torch.no_grad():
        ours(**batch(ROWS), past_key_values=cache, logits_to_keep=1)
    before = (list(cache.lengths), list(cache.rope_deltas))
    follow = Row([3, ("image", 4, 4), 2], seed=9)  # 4 image tokens over 2 positions: the deltas change
    inputs = batch([follow] * 3)
    inputs["attention_mask"] = torch.cat([batch(ROWS)["attention_mask"], inputs["attention_mask"]], 1)
    layer = ours.model.language_model.layers[-1]

    def fail(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(layer, "forward", fail)
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        ours(**inputs, past_key_values=cache)
    assert (cache.lengths, cache.rope_deltas) == before


def test_checkpoint_missing_vision_weights_loads_and_reports_them_as_transformers(models, tmp_path):
    """The vision merger's weights left out of the checkpoint: initialised and reported missing, as transformers'
    class reports them (no refusal)."""
    ref, _, _ = models
    dropped = {k for k in ref.state_dict() if k.startswith("model.visual.merger.")}
    assert dropped
    state = {k: v for k, v in ref.state_dict().items() if k not in dropped}
    ref.save_pretrained(tmp_path, state_dict=state)
    _, info = Qwen4ExpForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    _, their_info = type(ref).from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == dropped
    assert info == their_info


def test_row_placement_moves_each_rows_delta(models):
    """Continuous batching places rows one by one (`move_rows`): a row's delta goes with it, a fresh row has none."""
    _, ours, _ = models
    cache = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=80)
    with torch.no_grad():
        ours(**batch(ROWS), past_key_values=cache, logits_to_keep=1)
    d = list(cache.rope_deltas[:3])
    cache.move_rows([1, -1, 0])
    assert cache.rope_deltas[:3] == [d[1], 0, d[0]]


def test_continuous_batching_with_media(models, upstream_alone):
    """Requests carry their own media (`add_request(..., pixel_values=...)`); a tiny pool forces preemption and a
    5-token budget cuts prefill chunks inside images; every request equals upstream on its prompt alone."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    _, ours, _ = models
    config = ContinuousBatchingConfig(page_size=4, num_blocks=19, max_batch_tokens=5, max_requests_per_batch=3)
    manager = ours.init_continuous_batching(GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                                                             eos_token_id=None, pad_token_id=0), config)
    manager.start()
    try:
        for i, r in enumerate(ROWS):
            inputs = batch([r])
            ids = inputs.pop("input_ids")[0].tolist()
            inputs.pop("attention_mask")
            manager.add_request(ids, request_id=f"r{i}", **inputs)
        results = collect_results(manager, len(ROWS))
    finally:
        manager.stop(block=True)
    assert manager.stats["preemptions"] > 0
    assert not manager.runner.encoded  # each finished request's media encoding was let go
    prefix = manager.cache.memory_stats()["prefix_cache"]
    assert prefix["entries"] == 0 and prefix["lookup_tokens"] == 0  # requests with media: not cached, not restored
    for i, (tokens, _) in enumerate(upstream_alone):
        assert results[f"r{i}"].error is None
        assert results[f"r{i}"].generated_tokens == tokens, f"request {i}"


def test_a_text_prompt_prefills_in_grouped_steps_beside_a_decoding_row_with_media(models, upstream_alone):
    """A request with images decodes (its RoPE positions offset by its images: `rope_deltas`) while a text prompt
    prefills in chunks beside it, in grouped steps: both equal upstream on their prompts alone."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    _, ours, _ = models
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=5, max_requests_per_batch=2)
    manager = ours.init_continuous_batching(GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                                                             eos_token_id=None, pad_token_id=0), config,
                                             grouped_steps=True)
    manager.start()
    try:
        inputs = batch([ROWS[0]])
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask")
        manager.add_request(ids, request_id="media", streaming=True, **inputs)
        next(manager.request_id_iter("media"))  # it decodes
        assert manager.cache.rope_deltas[0] != 0
        manager.add_request(ROWS[2].ids, request_id="text")
        results = {r.request_id: r for r in [manager.get_result("media", timeout=60)]}
        while not results["media"].is_finished():
            results["media"] = manager.get_result("media", timeout=60)
        results["text"] = manager.get_result("text", timeout=60)
        stats = dict(manager.stats)
    finally:
        manager.stop(block=True)
    assert stats["grouped_steps"] >= 3
    assert results["media"].generated_tokens == upstream_alone[0][0]
    assert results["text"].generated_tokens == upstream_alone[2][0]


def test_text_model_refuses_media_in_a_request():
    from helpers.qwen4 import make_pair

    _, text_only = make_pair()
    manager = text_only.init_continuous_batching()
    with pytest.raises(ValueError, match="takes no media"):
        manager.add_request([5, 6, 7], pixel_values=torch.zeros(4, PATCH_FEATURES))


def test_training_loss_and_vision_gradients_equal_upstream(models):
    """A forward with labels (no cache): the loss and the gradients reaching the vision tower equal upstream's."""
    ref, ours, _ = models
    inputs = batch(ROWS[:1])
    losses, grads = [], []
    for model in (ref, ours):
        model.zero_grad()
        out = model(**inputs, labels=inputs["input_ids"], use_cache=False)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append(model.model.visual.merger.linear_fc2.weight.grad.clone())
    ref.zero_grad()
    ours.zero_grad()
    assert (losses[0] - losses[1]).abs().item() < 1e-5
    assert (grads[0] - grads[1]).abs().max().item() < 1e-5 * max(1.0, grads[0].abs().max().item())
