"""Inkling with images and audio on QSAPagedCache against transformers' own InklingForConditionalGeneration
(CPU, fp32).

The checkpoint is written by transformers' class (every float weight random, MTP layers included) and loaded
by ours with `from_pretrained`. Media are built as transformers' processor builds them: ``pixel_values``
``[patches, temporal_patch_size, patch_size, patch_size, 3]`` (`InklingImageProcessor`: a patch grid of
``ceil(H / p)`` rows and ``W // p + 1`` columns, padded with -1, repeated over time; one placeholder per
patch), ``audio_input_ids`` ``[clips, frames, n_mel_bins]`` dMel bins of `InklingFeatureExtractor`'s log-mel
frames with ``audio_input_ids_mask`` (one placeholder per valid frame).

Each row of a left-padded ragged batch must generate what upstream generates on that row alone, unpadded,
with its own media (upstream's log scaling counts pad positions, so its padded batch drifts). The text
model is small but every mechanism acts: sliding windows evict (window 6), the relative extent (12) and log
scaling are active, both layer kinds and both MLP kinds appear, logits are divided by the muP multiplier and
cut to the unpadded vocabulary (the placeholder ids lie past it, so the model never generates them).
The same holds with chunked prefill cutting through images, prompt lookup and MTP drafts, and continuous
batching of requests that carry their own media.
"""

from __future__ import annotations

import types

import pytest
import torch
from helpers.qwen4 import collect_results, randomize_
from safetensors.torch import load_file, save_file
from transformers import InklingConfig
from transformers import InklingForConditionalGeneration as UpstreamInkling
from transformers.modeling_layers import MtpModel
from transformers.models.inkling.feature_extraction_inkling import InklingFeatureExtractor
from transformers.models.inkling.processing_inkling import InklingProcessor

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.cuda_graphs import graphs_of
from modeling import InklingForConditionalGeneration
from modeling.inkling_mtp import InklingMtpModel

WINDOW = 6
BLOCK = 4
PATCH = 2
MEL_BINS = 8
DMEL_BINS = 16  # InklingProcessor's default num_dmel_bins
BOS, IMAGE_BOS, AUDIO_BOS = 1, 2, 3
UNPADDED = 28
IMAGE, AUDIO = 30, 31  # placeholders, past the unpadded vocabulary
N = 10  # new tokens
N_DRAFTING = 16  # new tokens with drafts (enough for some to be accepted)


def make_config() -> InklingConfig:
    text = dict(
        vocab_size=32, unpadded_vocab_size=UNPADDED, hidden_size=64, num_hidden_layers=5,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        sliding_window_size=WINDOW, d_rel=4, rel_extent=12, log_scaling_n_floor=4, log_scaling_alpha=0.5,
        conv_kernel_size=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, dense_mlp_idx=2, logits_mup_width_multiplier=1.5,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=BOS, eos_token_id=None, num_mtp_layers=2,
    )
    # Three vision layers: patch 2 folds space (2x2), then time (2), then projects to the text width.
    vision = dict(patch_size=PATCH, temporal_patch_size=2, num_hidden_layers=3)
    audio = dict(n_mel_bins=MEL_BINS, mel_vocab_size=DMEL_BINS)
    return InklingConfig(text_config=text, vision_config=vision, audio_config=audio, image_token_id=IMAGE,
                         audio_token_id=AUDIO, image_bos_token_id=IMAGE_BOS, audio_bos_token_id=AUDIO_BOS)


# ----------------------------------------------------------------------------- media as the processor builds them
def image_patches(height: int, width: int, gen) -> torch.Tensor:
    """``pixel_values`` of one ``height x width`` image, as `InklingImageProcessor._preprocess` lays them out."""
    image = torch.randn(3, height, width, generator=gen)
    patches = []
    for i in range(-(-height // PATCH)):
        for j in range(width // PATCH + 1):
            patch = image[:, i * PATCH:(i + 1) * PATCH, j * PATCH:(j + 1) * PATCH]
            patches.append(torch.nn.functional.pad(
                patch, (0, PATCH - patch.shape[2], 0, PATCH - patch.shape[1]), value=-1.0))
    return torch.stack(patches)[..., None].repeat(1, 1, 1, 1, 2).permute(0, 4, 2, 3, 1)


def audio_clips(samples: list[int], gen) -> tuple[torch.Tensor, torch.Tensor]:
    """``(audio_input_ids, audio_input_ids_mask)`` of clips of these many samples at 16 kHz, as `InklingProcessor`
    builds them (its feature extractor's log-mel frames, quantized to dMel bins)."""
    extractor = InklingFeatureExtractor(feature_size=MEL_BINS)
    hop = extractor.hop_length
    clips = []
    for n in samples:  # each frame a few tones of random pitch and loudness: the dMel bins vary
        frames = -(-n // hop)
        t = torch.arange(frames * hop).view(frames, hop) / extractor.sampling_rate
        pitch = 100 + torch.rand(frames, 3, 1, generator=gen) * 7000
        loudness = 10.0 ** (torch.rand(frames, 3, 1, generator=gen) * 4 - 3)
        clips.append((loudness * torch.sin(2 * torch.pi * pitch * t[:, None])).sum(1).flatten()[:n].numpy())
    features = extractor(clips, sampling_rate=extractor.sampling_rate, return_tensors="pt")
    quantizer = types.SimpleNamespace(dmel_min_value=-7.0, dmel_max_value=2.0,
                                      bin_centers=torch.linspace(-7.0, 2.0, DMEL_BINS, dtype=torch.float64).float())
    return InklingProcessor._extract_dmel_bins(quantizer, features["input_features"]), features["input_features_mask"]


class Batch:
    """Three rows: two images and an audio clip; text only; an audio clip and three images. Images of five
    sizes (6, 9, 4, 6 and 8 patches), clips of 5 and 4 frames (padded to 5)."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        images = [image_patches(h, w, gen) for h, w in ((4, 4), (6, 4), (2, 6), (3, 5), (4, 6))]
        self.audio_ids, self.audio_mask = audio_clips([3900, 2900], gen)  # 5 and 4 frames

        def text(n):
            return torch.randint(4, UNPADDED, (n,), generator=gen).tolist()

        def image(i):
            return [IMAGE_BOS] + [IMAGE] * images[i].shape[0]

        def clip(i):
            return [AUDIO_BOS] + [AUDIO] * int(self.audio_mask[i].sum())

        # Row 2 ends with the two tokens that precede its first image: prompt lookup drafts that image's marker
        # and placeholders in its first round.
        again = text(2)
        self.rows = [
            [BOS] + text(2) + image(0) + text(3) + clip(0) + text(2) + image(1) + text(2),
            [BOS] + text(10),
            [BOS] + text(1) + clip(1) + again + image(2) + text(2) + image(3) + text(1) + image(4) + text(1) + again,
        ]
        self.pixels = [torch.cat([images[0], images[1]]), None, torch.cat([images[2], images[3], images[4]])]
        self.clips = [0, None, 1]
        width = max(len(r) for r in self.rows)
        self.ids = torch.zeros(len(self.rows), width, dtype=torch.long)
        self.mask = torch.zeros_like(self.ids)
        for i, r in enumerate(self.rows):
            self.ids[i, width - len(r):] = torch.tensor(r)
            self.mask[i, width - len(r):] = 1

    def media(self, row: int | None = None) -> dict:
        """generate()'s media arguments for the whole batch (in row order) or one row."""
        rows = range(len(self.rows)) if row is None else [row]
        pixels = [self.pixels[r] for r in rows if self.pixels[r] is not None]
        clips = [self.clips[r] for r in rows if self.clips[r] is not None]
        out = {}
        if pixels:
            out["pixel_values"] = torch.cat(pixels)
        if clips:
            out["audio_input_ids"], out["audio_input_ids_mask"] = self.audio_ids[clips], self.audio_mask[clips]
        return out

    def row(self, i: int) -> torch.Tensor:
        return torch.tensor([self.rows[i]])


def greedy(model, ids, mask=None, n=N, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                              max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0, eos_token_id=None, **kwargs)


# ----------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(upstream model, checkpoint dir) of transformers' class, with two MTP layers' weights under ``model.mtp.``."""
    upstream = UpstreamInkling(make_config()).eval()
    randomize_(upstream, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in upstream.named_buffers():  # the router's correction bias is a checkpoint weight too
            if "e_score_correction_bias" in name:
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)
    mtp = MtpModel(upstream, 2)
    shared = ("embed_tokens", "shared_head")  # the main model's embedding and head (shared_head *is* lm_head)
    gen = torch.Generator().manual_seed(5)  # MTP drafts that are sometimes right (checked below, not assumed)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if not name.startswith(shared):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "norm" in name else 0.3))
    extra = {f"model.mtp.{k}": v for k, v in mtp.state_dict().items() if not k.startswith(shared)}
    path = tmp_path_factory.mktemp("inkling_mm")
    upstream.save_pretrained(path, state_dict={**upstream.state_dict(), **extra})
    return upstream, path


@pytest.fixture(scope="module")
def models(checkpoint):
    upstream, path = checkpoint
    return upstream, InklingForConditionalGeneration.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def batch():
    return Batch()


_reference: dict = {}


def upstream_row(upstream, batch, i, n=N):
    """Upstream greedy generation on row ``i`` alone, unpadded, with its media (memoized)."""
    key = (upstream, batch, i, n)  # the objects, not their ids (ids of freed objects are reused)
    if key not in _reference:
        out = greedy(upstream, batch.row(i), n=n, **batch.media(i))
        _reference[key] = (out.sequences[0, len(batch.rows[i]):], torch.stack([s[0] for s in out.logits]))
    return _reference[key]


def assert_row_matches(upstream, batch, i, out, b=None, n=N):
    """Row ``i`` of the batch, at row ``b`` of ``out`` (default: ``i``), against upstream on the row alone."""
    b = i if b is None else b
    ref_tokens, ref_logits = upstream_row(upstream, batch, i, n)
    got_tokens = out.sequences[b, out.sequences.shape[1] - n:]
    assert torch.equal(got_tokens, ref_tokens), f"row {i}: {got_tokens.tolist()} vs upstream {ref_tokens.tolist()}"
    got_logits = torch.stack([s[b] for s in out.logits])
    torch.testing.assert_close(got_logits, ref_logits, atol=2e-4, rtol=0, msg=lambda m: f"row {i}: {m}")


# ----------------------------------------------------------------------------- loading
def test_from_pretrained_loads_every_upstream_weight(checkpoint, models, tmp_path):
    upstream, path = checkpoint
    _, ours = models
    theirs = upstream.state_dict()
    mine = ours.state_dict()
    assert set(mine) == set(theirs)
    for name, value in theirs.items():
        assert torch.equal(mine[name], value), name
    assert ours.config.get_mtp_config().num_hidden_layers == 2  # the MTP config is found on the composite config
    # A checkpoint without a tower weight loads: the weight is initialised and reported missing, as transformers'
    # class reports it.
    (file,) = path.glob("*.safetensors")
    weights = load_file(file)
    # checkpoint name (the release layout transformers saves) -> the parameter it loads into
    towers = {"model.visual.layers.linear_1.weight": "model.vision_tower.encoder_layers.1.projection.weight",
              "model.audio.encoder.weight": "model.audio_tower.embed_audio_tokens.embed_audio_tokens.weight"}
    for dropped, parameter in towers.items():
        broken = tmp_path / dropped
        broken.mkdir()
        for other in path.iterdir():
            if other.suffix == ".json":
                (broken / other.name).write_text(other.read_text())
        save_file({k: v for k, v in weights.items() if k != dropped}, broken / file.name,
                  metadata={"format": "pt"})
        _, info = InklingForConditionalGeneration.from_pretrained(broken, output_loading_info=True)
        _, their_info = UpstreamInkling.from_pretrained(broken, output_loading_info=True)
        assert info["missing_keys"] == {parameter}
        assert info == their_info


# ----------------------------------------------------------------------------- forward
def test_forward_matches_upstream_per_row(models, batch):
    """One forward of the padded batch: logits and router logits at every real position (inside image and audio
    spans too), the image features, and the loss of a row, as upstream gives them for each row alone."""
    upstream, ours = models
    with torch.no_grad():
        out = ours(batch.ids, attention_mask=batch.mask, output_router_logits=True, **batch.media())
        assert out.past_key_values is None or isinstance(out.past_key_values, QSAPagedCache)
        features = upstream.model.get_image_features(batch.media()["pixel_values"]).pooler_output
        torch.testing.assert_close(out.image_hidden_states, features, atol=0, rtol=0)
        B, L = batch.ids.shape
        for i, row in enumerate(batch.rows):
            ref = upstream(batch.row(i), output_router_logits=True, **batch.media(i))
            torch.testing.assert_close(out.logits[i, -len(row):], ref.logits[0], atol=2e-4, rtol=0,
                                       msg=lambda m: f"row {i}: {m}")
            assert len(out.router_logits) == len(ref.router_logits) > 0
            for layer, logits in enumerate(out.router_logits):
                torch.testing.assert_close(logits.view(B, L, -1)[i, -len(row):], ref.router_logits[layer],
                                           atol=1e-4, rtol=0, msg=lambda m: f"row {i}, layer {layer}: {m}")
        labels = batch.row(2).masked_fill(batch.row(2) >= UNPADDED, -100)  # no loss on placeholders
        ref = upstream(batch.row(2), labels=labels, **batch.media(2))
        loss, logits = ours(batch.row(2), labels=labels, return_dict=False, **batch.media(2))[:2]
    torch.testing.assert_close(loss, ref.loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, ref.logits, atol=2e-4, rtol=0)


# ----------------------------------------------------------------------------- generation
@pytest.mark.parametrize("cache", ["default", "explicit"])
def test_ragged_batch_matches_upstream_per_row(models, batch, cache):
    upstream, ours = models
    kwargs = {}
    if cache == "explicit":
        kwargs["past_key_values"] = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=batch.ids.shape[1] + N,
                                                  block_size=BLOCK)
    out = greedy(ours, batch.ids, batch.mask, **kwargs, **batch.media())
    if cache == "explicit":
        assert out.past_key_values is kwargs["past_key_values"]
    for i in range(len(batch.rows)):
        assert_row_matches(upstream, batch, i, out)


def test_chunked_prefill_cuts_through_images(models, batch, monkeypatch):
    """A prompt over `prefill_chunk_tokens` is embedded once and prefilled in chunks cutting image spans."""
    upstream, ours = models
    B, L = batch.ids.shape
    chunk = 5
    monkeypatch.setattr(ours, "prefill_chunk_tokens", B * chunk)
    ends = list(range(L, 0, -chunk))[::-1]
    cut = [e for e in ends[:-1] if any(r[-(L - e)] == IMAGE and r[-(L - e) - 1] == IMAGE
                                         for r in batch.rows if L - e < len(r))]
    assert cut, "no chunk boundary falls inside an image"
    steps = []
    hook = ours.language_model.register_forward_pre_hook(lambda m, a, kw: steps.append(kw["inputs_embeds"] is not None
                                                                                       or None), with_kwargs=True)
    try:
        out = greedy(ours, batch.ids, batch.mask, **batch.media())
    finally:
        hook.remove()
    # The prompt runs from its embeddings, in chunks; decode steps run from token ids.
    assert steps[:len(ends) + 1] == [True] * len(ends) + [None], steps
    for i in range(len(batch.rows)):
        assert_row_matches(upstream, batch, i, out)


class ForwardLog:
    """The main model's forwards during a generate() call: how many, and which carried media."""

    def __init__(self, model):
        self.media = []
        self.hook = model.register_forward_pre_hook(
            lambda m, a, kw: self.media.append(kw.get("pixel_values") is not None
                                               or kw.get("audio_input_ids") is not None), with_kwargs=True)

    def close(self):
        self.hook.remove()
        return self.media


@pytest.mark.parametrize("mode", ["prompt_lookup", "mtp"])
def test_drafting_with_media_matches_upstream(checkpoint, models, batch, mode, monkeypatch):
    """Speculative decoding (one row at a time: transformers drafts for batch size 1) with media in the prompt."""
    upstream, ours = models
    drafting = {"prompt_lookup": dict(prompt_lookup_num_tokens=3), "mtp": dict(use_mtp=True)}[mode]
    rejected = []  # tokens each crop of the cache dropped
    crop = QSAPagedCache.crop
    monkeypatch.setattr(QSAPagedCache, "crop", lambda cache, n: (rejected.append(-n), crop(cache, n))[1])
    accepted = []
    for i in range(len(batch.rows)):
        log = ForwardLog(ours)
        try:
            out = greedy(ours, batch.row(i), n=N_DRAFTING, **drafting, **batch.media(i))
        finally:
            media = log.close()
        assert_row_matches(upstream, batch, i, out, b=0, n=N_DRAFTING)
        # Media go into the first forward only (the prefill, with drafts when prompt lookup finds some).
        assert media[0] == (batch.pixels[i] is not None or batch.clips[i] is not None) and not any(media[1:])
        accepted.append(N_DRAFTING - len(media))  # each forward yields one token plus its accepted drafts
    assert any(accepted[i] for i in (0, 2)), f"no draft accepted on a row with media: {accepted}"
    assert sum(rejected) > 0, "no draft was ever rejected"
    if mode == "mtp":  # the MTP layers' weights are found in the multimodal checkpoint (and nothing else)
        (file,) = checkpoint[1].glob("*.safetensors")
        keys = load_file(file).keys()
        assert {k for k in keys if InklingMtpModel.get_mtp_weights_regex(ours).search(k)} == {
            k for k in keys if k.startswith("model.mtp.")} != set()
    if mode == "prompt_lookup":
        # Row 2's prompt makes prompt lookup draft image placeholders in the first round, which upstream cannot
        # verify (they have no features in the forward that carries the media); ours cuts drafts before them.
        with pytest.raises(ValueError, match="placeholder tokens do not match"):
            greedy(upstream, batch.row(2), **drafting, **batch.media(2))


@pytest.mark.parametrize("loop", ["prompt lookup", "plain greedy"])
def test_greedy_with_media_in_our_loop_equals_transformers_loop(models, batch, loop, monkeypatch):
    """One row of greedy decoding with media takes our loops (`lookup_decoding`, `decode_loop`) when no per-step
    outputs are asked for, with prompt lookup or without: the same tokens as transformers' loop, row by row
    (prompt lookup's drafts cut before a media placeholder in the first round as there)."""
    from hf_qsa_cache import decode_loop, lookup_decoding

    module, name, extra = {
        "prompt lookup": (lookup_decoding, "decode_with_prompt_lookup", {"prompt_lookup_num_tokens": 3}),
        "plain greedy": (decode_loop, "decode", {})}[loop]
    _, ours = models
    ran = []
    decode = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: ran.append(1) or decode(*a, **k))

    def generate(i):
        with torch.no_grad():
            return ours.generate(batch.row(i), attention_mask=torch.ones_like(batch.row(i)), max_new_tokens=N_DRAFTING,
                                 do_sample=False, pad_token_id=0, eos_token_id=None, **extra, **batch.media(i))

    for i in range(len(batch.rows)):
        ran.clear()
        mine = generate(i)
        assert ran, "our loop did not run"
        with monkeypatch.context() as m:  # transformers' loop
            m.setattr(lookup_decoding, "applies", lambda *a, **k: False)
            m.setattr(type(ours), "lean_decoding", False)
            theirs = generate(i)
        assert torch.equal(mine, theirs), i


def test_recorded_decode_step_after_a_media_prefill(models, batch):
    """The decode step a CUDA graph records (`DecodeGraphs(record=False)`, run eagerly on the CPU) continues a
    media prefill as the ordinary forward does."""
    _, ours = models
    B, L = batch.ids.shape
    eager, static = (QSAPagedCache(ours.config, B, L + 8, block_size=BLOCK) for _ in range(2))
    runner = graphs_of(ours, static, "cpu", record=False)
    mask = batch.mask
    with torch.no_grad():
        logits = ours(batch.ids, attention_mask=mask, past_key_values=eager, **batch.media()).logits[:, -1:]
        ours(batch.ids, attention_mask=mask, past_key_values=static, **batch.media())
        for step in range(5):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            logits = ours(nxt, attention_mask=mask, past_key_values=eager).logits
            got = runner.step(nxt, None, mask)
            # capacity-sized key sets: another fp32 summation order (see test_decode_graphs)
            torch.testing.assert_close(got, logits, atol=5e-5, rtol=0, msg=lambda m: f"step {step}: {m}")
    assert static.lengths == eager.lengths


def test_continuing_a_cache_is_checked_against_the_placeholders(models, batch):
    """The media step logs its placeholder ids, so a later generate() on the cache is checked as for text."""
    upstream, ours = models
    B, L = batch.ids.shape
    more = 4
    cache = QSAPagedCache(ours.config, max_batch_size=B, max_cache_len=L + N + more + N, block_size=BLOCK)
    first = greedy(ours, batch.ids, batch.mask, past_key_values=cache, **batch.media())
    tail = torch.randint(4, UNPADDED, (B, more), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([first.sequences, tail], dim=1)
    mask = torch.cat([batch.mask, torch.ones(B, N + more, dtype=torch.long)], dim=1)
    wrong = ids.clone()
    wrong[2, L - 3] = AUDIO if wrong[2, L - 3] == IMAGE else IMAGE  # a placeholder of another kind
    with pytest.raises(ValueError, match="row 2 of input_ids does not start with the tokens the cache holds"):
        greedy(ours, wrong, mask, past_key_values=cache)
    second = greedy(ours, ids, mask, past_key_values=cache)  # no media: the cache holds them
    for i in range(B):  # upstream on the whole row alone, its media in the one forward
        row = ids[i][mask[i].bool()][None]
        ref = greedy(upstream, row, **batch.media(i))
        assert torch.equal(second.sequences[i, ids.shape[1]:], ref.sequences[0, row.shape[1]:]), f"row {i}"
        torch.testing.assert_close(torch.stack([s[i] for s in second.logits]),
                                   torch.stack([s[0] for s in ref.logits]), atol=2e-4, rtol=0)


def test_right_padded_media_step_logs_each_rows_ids(models, batch):
    """A right-padded step runs reordered for the layers (`hf_qsa_cache.padding`): the placeholder ids are
    reordered with the embeddings, so the log holds each row's ids in order."""
    _, ours = models
    B, L = batch.ids.shape
    ids, mask = torch.zeros_like(batch.ids), torch.zeros_like(batch.mask)
    for i, row in enumerate(batch.rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    cache = QSAPagedCache(ours.config, B, L, block_size=BLOCK)
    with torch.no_grad():
        ours(ids, attention_mask=mask, past_key_values=cache, **batch.media())
    assert cache.token_log.complete
    for i, row in enumerate(batch.rows):
        assert cache.token_log.ids[i, :len(row)].tolist() == row, f"row {i}"


def test_continuous_batching_with_media(models, batch):
    """Requests carry their own media (`add_request(..., pixel_values=..., audio_input_ids=...)`); a tiny pool
    forces preemption and a 5-token budget cuts prefill chunks inside images and clips; every request equals
    upstream on its prompt alone."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    upstream, ours = models
    config = ContinuousBatchingConfig(page_size=4, num_blocks=19, max_batch_tokens=5, max_requests_per_batch=3)
    manager = ours.init_continuous_batching(GenerationConfig(max_new_tokens=N, do_sample=False, eos_token_id=None,
                                                             pad_token_id=0), config)
    manager.start()
    try:
        for i, row in enumerate(batch.rows):
            manager.add_request(row, request_id=f"r{i}", **batch.media(i))
        results = collect_results(manager, len(batch.rows))
    finally:
        manager.stop(block=True)
    assert manager.stats["preemptions"] > 0
    assert not manager.runner.encoded  # each finished request's media encoding was let go
    for i in range(len(batch.rows)):
        assert results[f"r{i}"].error is None, results[f"r{i}"].error
        assert results[f"r{i}"].generated_tokens == upstream_row(upstream, batch, i)[0].tolist(), f"request {i}"
