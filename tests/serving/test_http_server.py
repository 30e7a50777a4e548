"""`hf-qsa-serve` as a client sees it: real server processes on free ports, the official `openai` client.

Three servers, started together for the module: a text Qwen4Exp checkpoint (API key on, small limits), an
Inkling multimodal checkpoint (audio) and a Qwen4Exp multimodal checkpoint (images); each a tiny random model
saved by transformers' class with a character tokenizer and a ChatML template (`helpers.http_server`). Each
runs its engine in a process of its own, as `hf-qsa-serve` does by default; a fourth server, started only for
its test, runs the text checkpoint with ``--engine-in-process``.

Every greedy answer is compared, token for token, with `generate()` of our class on that prompt alone (the
server returns its token ids with the ``return_token_ids`` extension); texts are the tokenizer's decoding of
those tokens.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import types
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("PIL")

from helpers import http_server as hs  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

KEY = "test-key-123"
MAX_TOKENS = 400  # the text server's limit (the disconnect test asks for all of it)
QWEN_FLAGS = ("--max-tokens", str(MAX_TOKENS), "--max-n", "4", "--max-prompt-tokens", "120", "--max-body-bytes",
              "100000", "--cb-max-requests", "6", "--cb-block-size", "4")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    paths = {"qwen": hs.qwen4_exp_text(root / "qwen-tiny"), "inkling": hs.inkling_audio(root / "inkling-tiny"),
             "image": hs.qwen4_exp_image(root / "qwen-image-tiny")}
    procs = {
        "qwen": hs.ServerProcess(paths["qwen"], *QWEN_FLAGS, env={"HF_QSA_API_KEY": KEY}, log=root / "qwen.log"),
        "inkling": hs.ServerProcess(paths["inkling"], "--cb-block-size", "4", "--shutdown-timeout", "1",
                                    log=root / "inkling.log"),
        "image": hs.ServerProcess(paths["image"], "--cb-block-size", "4", log=root / "image.log"),
    }
    try:
        for proc in procs.values():
            proc.wait()
        yield {name: types.SimpleNamespace(proc=procs[name], path=paths[name]) for name in procs}
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def in_process_server(servers, tmp_path_factory):
    """The text checkpoint served with ``--engine-in-process`` (the engine a thread of the server's process)."""
    log = tmp_path_factory.mktemp("http-in-process") / "qwen.log"
    proc = hs.ServerProcess(servers["qwen"].path, *QWEN_FLAGS, "--engine-in-process", env={"HF_QSA_API_KEY": KEY},
                            log=log)
    try:
        yield types.SimpleNamespace(proc=proc.wait(), path=servers["qwen"].path)
    finally:
        proc.stop()


def gone(pid: int) -> bool:
    """No such process, not even a zombie (an exited child its parent never waited for)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "X"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def client(server, key=None) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.proc.url + "/v1", api_key=key or "none", max_retries=0, timeout=60)


def health(server, key=None) -> dict:
    request = urllib.request.Request(server.proc.url + "/health")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return {"http_status": error.code, **json.loads(error.read())}


def post(server, route: str, body, key=KEY, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(server.proc.url + route, data=data, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


# ----------------------------------------------------------------------------- references
class Reference:
    """Our class loaded from the served checkpoint: greedy `generate()` on one prompt alone."""

    def __init__(self, path, cls):
        self.model = cls.from_pretrained(path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.memo = {}

    def chat_ids(self, content: str) -> list[int]:
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def generate(self, ids: list[int], n: int, **media) -> list[int]:
        key = (tuple(ids), n)
        if media or key not in self.memo:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          max_new_tokens=n, do_sample=False, eos_token_id=hs.EOS, pad_token_id=0,
                                          **media)
            tokens = out[0, len(ids):].tolist()
            if media:
                return tokens
            self.memo[key] = tokens
        return self.memo[key]

    def decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def qwen_ref(servers):
    from modeling import Qwen4ExpForCausalLM

    return Reference(servers["qwen"].path, Qwen4ExpForCausalLM)


@pytest.fixture(scope="module")
def inkling_ref(servers):
    from modeling import InklingForConditionalGeneration

    return Reference(servers["inkling"].path, InklingForConditionalGeneration)


PROMPTS = ["Hello there", "What is 2 + 2?", "Tell me a story about a cat.", "ok", "Zebra crossing, 42 times!"]
IDS = {"return_token_ids": True}


def chat(c, model, content, max_tokens, stream=False, **kwargs):
    """(token ids, text, finish reason, usage) of one chat request, streamed or not."""
    messages = [{"role": "user", "content": content}]
    if not stream:
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                      extra_body=IDS, **kwargs)
        return r.choices[0].token_ids, r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    tokens, text, finish, usage = [], "", None, None
    for chunk in c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, extra_body=IDS,
                                           **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            tokens += getattr(choice, "token_ids", None) or []
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return tokens, text, finish, usage


def complete(c, model, prompt, max_tokens, stream=False, **kwargs):
    if not stream:
        r = c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=IDS,
                                 **kwargs)
        return r.choices[0].token_ids, r.choices[0].text, r.choices[0].finish_reason, r.usage
    tokens, text, finish, usage = [], "", None, None
    for chunk in c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body=IDS, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            tokens += getattr(choice, "token_ids", None) or []
            text += choice.text or ""
            finish = choice.finish_reason or finish
    return tokens, text, finish, usage


def check(ref, prompt_ids, n, got):
    tokens, text, finish, usage = got
    want = ref.generate(prompt_ids, n)
    assert tokens == want, f"prompt {prompt_ids}: server {tokens}, generate() alone {want}"
    assert text == ref.decode(want)
    assert finish == ("stop" if want[-1] == hs.EOS else "length")
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), len(want))
    assert usage.total_tokens == len(prompt_ids) + len(want)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("engine, stream", [("process", False), ("process", True), ("in-process", True)],
                         ids=["whole", "streamed", "engine-in-process"])
def test_chat_and_completions_equal_generate_alone(request, servers, qwen_ref, engine, stream):
    server = servers["qwen"] if engine == "process" else request.getfixturevalue("in_process_server")
    assert health(server)["engine"] == engine
    c = client(server, KEY)
    for k, prompt in enumerate(PROMPTS[:3]):
        check(qwen_ref, qwen_ref.chat_ids(prompt), 6 + k, chat(c, "qwen-tiny", prompt, 6 + k, stream))
        check(qwen_ref, qwen_ref.text_ids(prompt), 5 + k, complete(c, "qwen-tiny", prompt, 5 + k, stream))
    ids = [5, 9, 33, 2, 70, 8]  # a prompt of token ids
    check(qwen_ref, ids, 7, complete(c, "qwen-tiny", ids, 7, stream))


def test_null_for_an_optional_field_means_its_default(servers):
    """Clients that send every field send null for those they leave to the server (OpenAI's schema allows it)."""
    base = {"model": "qwen-tiny", "max_tokens": 5, "temperature": 0}
    nulls = {"n": None, "stream": None, "stream_options": None, "seed": None, "stop": None, "top_p": None}
    chat_body = {**base, "messages": [{"role": "user", "content": "Nulls"}]}
    for route, body, extra in [("/v1/chat/completions", chat_body, {"logprobs": None, "tools": None}),
                               ("/v1/completions", {**base, "prompt": "Nulls"}, {"echo": None, "logprobs": None})]:
        code, plain = post(servers["qwen"], route, body)
        code_nulls, with_nulls = post(servers["qwen"], route, {**body, **nulls, **extra})
        assert code == code_nulls == 200, with_nulls
        assert len(with_nulls["choices"]) == 1 and with_nulls["choices"][0] == plain["choices"][0]


def test_sixteen_concurrent_clients_each_equal_generate_alone(servers, qwen_ref):
    """16 clients at once (more than the 6 rows: some wait), mixed routes, streaming or not, lengths 3 to 18."""
    jobs = [(i, PROMPTS[i % len(PROMPTS)] + " " * (i // 5), 3 + i, i % 2 == 1, i % 4 < 2) for i in range(16)]

    def one(job):
        i, prompt, n, stream, is_chat = job
        c = client(servers["qwen"], KEY)
        if is_chat:
            return qwen_ref.chat_ids(prompt), n, chat(c, "qwen-tiny", prompt, n, stream)
        return qwen_ref.text_ids(prompt), n, complete(c, "qwen-tiny", prompt, n, stream)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, jobs))
    for ids, n, got in results:
        check(qwen_ref, ids, n, got)
    state = health(servers["qwen"])
    assert state["most_rows"] >= 2 and state["rows_in_use"] == 0 and state["inflight"] == 0


def test_a_client_that_disconnects_mid_stream_frees_its_row_at_once(servers):
    before = health(servers["qwen"])
    c = client(servers["qwen"], KEY)
    stream = c.completions.create(model="qwen-tiny", prompt="Keep going", max_tokens=MAX_TOKENS, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    seen = 0
    for _ in stream:
        seen += 1
        if seen == 3:
            break
    assert health(servers["qwen"])["rows_in_use"] == 1
    stream.close()
    deadline = time.monotonic() + 3
    while True:
        state = health(servers["qwen"])
        if state["rows_in_use"] == 0 and state["inflight"] == 0:
            break
        assert time.monotonic() < deadline, f"the row is still held: {state}"
        time.sleep(0.05)
    assert state["requests_cancelled"] == before["requests_cancelled"] + 1
    assert state["requests_finished"] == before["requests_finished"]  # it did not run to its 400 tokens
    assert state["decode_steps"] - before["decode_steps"] < MAX_TOKENS // 2


def test_n_seed_stop_and_logprobs(servers, qwen_ref):
    c = client(servers["qwen"], KEY)
    messages = [{"role": "user", "content": "Sample me"}]
    r = c.chat.completions.create(model="qwen-tiny", messages=messages, n=3, seed=11, temperature=1.0, top_p=0.9,
                                  max_tokens=10, extra_body=IDS)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(ch.token_ids) for ch in r.choices)
    # Choice i is seed 11 + i: the same request alone with seed 12 gives choice 1's tokens.
    again = c.chat.completions.create(model="qwen-tiny", messages=messages, seed=12, temperature=1.0, top_p=0.9,
                                      max_tokens=10, extra_body=IDS)
    assert again.choices[0].token_ids == r.choices[1].token_ids
    assert len({tuple(ch.token_ids) for ch in r.choices}) > 1  # sampled: the seeds differ
    # Greedy with logprobs: the chosen tokens' log-probabilities (each <= 0, one per token).
    g = c.chat.completions.create(model="qwen-tiny", messages=messages, temperature=0, max_tokens=8, logprobs=True,
                                  extra_body=IDS)
    values = [item.logprob for item in g.choices[0].logprobs.content]
    assert len(values) == len(g.choices[0].token_ids) and all(v <= 0 for v in values)
    # A stop string taken from the greedy answer: the text ends before it, finish_reason stop, fewer tokens.
    ids = qwen_ref.chat_ids("Hello there")
    full = qwen_ref.decode(qwen_ref.generate(ids, 12))
    cut = next(k for k in range(2, len(full)) if full[k] not in full[:k])  # first occurrence at k
    for stream in (False, True):
        # The first stop string never matches but begins like the second: text is held back, then sent.
        tokens, text, finish, usage = chat(c, "qwen-tiny", "Hello there", 12, stream,
                                           stop=[full[cut] + "\u00e9", full[cut]])
        assert text == full[:cut] and finish == "stop"
        assert usage.completion_tokens < 12


def test_malformed_requests_get_a_4xx_and_change_nothing(servers):
    server = servers["qwen"]
    before = health(server)
    good = {"model": "qwen-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ({**good, "unknown_field": 1}, 422, "unknown_field"),
        ({**good, "messages": []}, 422, "messages"),
        ({**good, "messages": [{"role": "wizard", "content": "hi"}]}, 422, "role"),
        ({**good, "temperature": 5}, 400, "temperature"),
        ({**good, "top_p": 0}, 400, "top_p"),
        ({**good, "n": 9}, 400, "n must lie in [1, 4]"),
        ({**good, "max_tokens": MAX_TOKENS + 1}, 400, "limit"),
        ({**good, "max_tokens": 0}, 400, "max_tokens"),
        ({**good, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({**good, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({**good, "reasoning_effort": "high"}, 400, "reasoning_effort"),
        ({**good, "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
         "stream_options.continuous_usage_stats"),
        ({**good, "stream_options": {"include_usage": True}}, 400, "only allowed with stream"),
        ({**good, "messages": [{"role": "user", "content": "x" * 150}]}, 400, "more than the limit 120"),
        ({**good, "messages": [{"role": "user", "content": [{"type": "image_url",
                                                              "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         400, "text only"),
    ]
    for body, status, words in cases:
        code, answer = post(server, "/v1/chat/completions", body)
        assert code == status, (body, answer)
        assert words in answer["error"]["message"] or words == answer["error"]["param"], answer
    completions = [({"model": "qwen-tiny", "prompt": [1, 2, 999]}, 400, "token ids must lie in"),
                   ({"model": "qwen-tiny", "prompt": "hi", "echo": True}, 400, "echo"),
                   ({"model": "qwen-tiny", "prompt": "hi", "logprobs": 5}, 400, "logprobs")]
    for body, status, words in completions:
        code, answer = post(server, "/v1/completions", body)
        assert code == status and words in answer["error"]["message"], answer
    responses = [{"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
                 {"reasoning": {"effort": "high"}}, {"truncation": "auto"}, {"tool_choice": "required"}]
    for extra in responses:
        code, answer = post(server, "/v1/responses", {"model": "qwen-tiny", "input": "hi", **extra})
        assert code == 400 and answer["error"]["param"].split(".")[0] in extra, answer
    assert post(server, "/v1/chat/completions", None, raw=b"{not json")[0] == 400
    assert post(server, "/v1/chat/completions", None, raw=b"[1, 2]")[0] == 400
    assert post(server, "/v1/chat/completions", None, raw=b"[" * 50_000 + b"]" * 50_000)[0] == 400  # too deep
    lone = {**good, "messages": [{"role": "user", "content": "hi \ud800"}]}  # valid JSON, not text
    code, answer = post(server, "/v1/chat/completions", lone)
    assert code == 400 and answer["error"]["param"] == "messages.0.content", answer
    code, answer = post(server, "/v1/completions", {"model": "qwen-tiny", "prompt": "\udc00abc"})
    assert code == 400 and answer["error"]["param"] == "prompt", answer
    assert post(server, "/v1/chat/completions", None, raw=b'{"model": "qwen-tiny", "messages": "' + b"x" * 120_000
                + b'"}')[0] == 413
    with pytest.raises(openai.BadRequestError):
        client(server, KEY).chat.completions.create(model="qwen-tiny", messages=[{"role": "user", "content": "hi"}],
                                                    temperature=3)
    after = health(server)
    assert after["status"] == "ok" and after["requests_submitted"] == before["requests_submitted"]
    assert after["rows_in_use"] == 0 and after["waiting"] == 0


def test_only_the_served_model_and_never_a_path(servers):
    server = servers["qwen"]
    before = health(server)
    c = client(server, KEY)
    for name in ["another/model", servers["inkling"].path, "/etc/passwd", "../qwen-tiny", "qwen-tiny@main"]:
        with pytest.raises(openai.NotFoundError, match="not served here"):
            c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model=name, prompt="hi", max_tokens=2)
        code, answer = post(server, "/load_model", {"model": name})
        assert code == 404, answer
    assert [m.id for m in c.models.list()] == ["qwen-tiny"]
    assert health(server)["requests_submitted"] == before["requests_submitted"]


def test_api_key(servers):
    server = servers["qwen"]
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong-key").chat.completions.create(model="qwen-tiny", max_tokens=2,
                                                            messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong-key").models.list()
    assert post(server, "/v1/completions", {"model": "qwen-tiny", "prompt": "hi"}, key="")[0] == 401
    assert health(server)["status"] == "ok"  # /health needs no key
    assert [m.id for m in client(server, KEY).models.list()] == ["qwen-tiny"]


def test_responses_route(servers, qwen_ref):
    c = client(servers["qwen"], KEY)
    ids = qwen_ref.chat_ids("Hello there")
    want = qwen_ref.decode(qwen_ref.generate(ids, 6))
    r = c.responses.create(model="qwen-tiny", input="Hello there", max_output_tokens=6, temperature=0)
    assert r.output_text == want and r.usage.input_tokens == len(ids)
    # Cut by the length limit (or ended by eos): the message item says so as its response does.
    assert r.output[0].status == r.status == ("incomplete" if r.usage.output_tokens == 6 else "completed")
    events = list(c.responses.create(model="qwen-tiny", input="Hello there", max_output_tokens=6, temperature=0,
                                     stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    item = next(e.item for e in events if e.type == "response.output_item.done")
    assert item.status == events[-1].response.status == r.status


def test_inkling_text_and_audio_chats_batched_together(servers, inkling_ref):
    """Text chats, completions and an audio chat at once on the multimodal Inkling server: each equals our class's
    generate() on its prompt alone (the audio's features built by transformers' feature extractor and dMel bins)."""
    from transformers.models.inkling.feature_extraction_inkling import InklingFeatureExtractor
    from transformers.models.inkling.processing_inkling import InklingProcessor

    server = servers["inkling"]
    wav = hs.wav_base64(4200, seed=3)
    audio_messages = [{"role": "user", "content": [{"type": "text", "text": "Listen: "},
                                                   {"type": "input_audio", "input_audio": {"data": wav,
                                                                                           "format": "wav"}},
                                                   {"type": "text", "text": " what?"}]}]

    def audio_request():
        r = client(server).chat.completions.create(model="inkling-tiny", messages=audio_messages, max_tokens=8,
                                                   temperature=0, extra_body=IDS)
        return r.prompt_token_ids, r.choices[0].token_ids

    def text_request(k):
        prompt = PROMPTS[k]
        if k % 2:
            return inkling_ref.text_ids(prompt), complete(client(server), "inkling-tiny", prompt, 6, stream=True)
        return inkling_ref.chat_ids(prompt), chat(client(server), "inkling-tiny", prompt, 6)

    with ThreadPoolExecutor(4) as pool:
        audio = pool.submit(audio_request)
        texts = list(pool.map(text_request, range(3)))
        prompt_ids, tokens = audio.result()
    for ids, got in texts:
        check(inkling_ref, ids, 6, got)
    # The reference: transformers' feature extractor and dMel quantization, one placeholder per valid frame.
    import base64

    import numpy as np

    raw = base64.b64decode(wav)
    samples = np.frombuffer(raw[44:], dtype="<i2").astype(np.float32) / 32768
    extractor = InklingFeatureExtractor.from_pretrained(server.path)
    features = extractor([samples], sampling_rate=16000, return_tensors="pt")
    quantizer = types.SimpleNamespace(dmel_min_value=-7.0, dmel_max_value=2.0,
                                      bin_centers=torch.linspace(-7.0, 2.0, 16, dtype=torch.float64).float())
    audio_ids = InklingProcessor._extract_dmel_bins(quantizer, features["input_features"])
    frames = int(features["input_features_mask"][0].sum())
    tok = inkling_ref.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": "Listen: <|audio_bos|><|audio|> what?"}],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    k = rendered.index(hs.I_AUDIO)
    expected = rendered[:k] + [hs.I_AUDIO] * frames + rendered[k + 1:]
    assert prompt_ids == expected and frames > 1
    want = inkling_ref.generate(expected, 8, audio_input_ids=audio_ids,
                                audio_input_ids_mask=features["input_features_mask"])
    assert tokens == want


def test_qwen_image_chats_batched_together(servers):
    """Two image chats (different sizes) and a text chat at once: each equals our class's generate() alone on the
    inputs transformers' image processor gives."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from modeling import Qwen4ExpForConditionalGeneration

    server = servers["image"]
    ref = Reference(server.path, Qwen4ExpForConditionalGeneration)
    images = {"small": hs.png_data_url(8, 8, seed=1), "wide": hs.png_data_url(8, 16, seed=2)}

    def ask(name):
        content = "Plain text only" if name == "text" else [
            {"type": "text", "text": "See "}, {"type": "image_url", "image_url": {"url": images[name]}},
            {"type": "text", "text": " ok?"}]
        r = client(server).chat.completions.create(model="qwen-image-tiny", max_tokens=7, temperature=0,
                                                   messages=[{"role": "user", "content": content}], extra_body=IDS)
        return name, r.prompt_token_ids, r.choices[0].token_ids

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, ["small", "wide", "text"]))
    processor = AutoImageProcessor.from_pretrained(server.path)
    import base64
    import io

    for name, prompt_ids, tokens in answers:
        if name == "text":
            assert tokens == ref.generate(ref.chat_ids("Plain text only"), 7)
            continue
        image = Image.open(io.BytesIO(base64.b64decode(images[name].split(",", 1)[1]))).convert("RGB")
        inputs = processor(images=[image], return_tensors="pt")
        count = int(inputs["image_grid_thw"][0].prod()) // 4
        rendered = ref.chat_ids("See <|vision_start|><|image_pad|><|vision_end|> ok?")
        k = rendered.index(hs.Q_IMAGE)
        expected = rendered[:k] + [hs.Q_IMAGE] * count + rendered[k + 1:]
        assert prompt_ids == expected and count >= 4
        ids = torch.tensor([expected])
        want = ref.generate(expected, 7, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                            mm_token_type_ids=(ids == hs.Q_IMAGE).long())
        assert tokens == want, name


def test_remote_media_urls_are_refused(servers):
    c = client(servers["image"])
    for url, words in [("http://127.0.0.1:1/x.png", "an image must come inside the request as a data: URL"),
                       ("file:///etc/passwd", "data: URL"), ("/etc/passwd", "data: URL"),
                       ("data:image/png,AAAA", "an image data: URL must be base64"),
                       ("data:image/png;base64,A*AA", "the image is not valid base64")]:
        with pytest.raises(openai.BadRequestError, match=words):
            c.chat.completions.create(model="qwen-image-tiny", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    with pytest.raises(openai.BadRequestError, match="cannot be read"):
        c.chat.completions.create(model="qwen-image-tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert health(servers["image"])["status"] == "ok"


def test_benchmark_script_runs_against_the_server_and_in_process(servers, tmp_path):
    """benchmarks/bench_http.py at tiny shapes against the running server and our engine in this process."""
    import os
    import sys

    sys.path.insert(0, os.path.join(hs.ROOT, "benchmarks"))
    import bench_http

    out = tmp_path / "http.jsonl"
    rows = bench_http.main(["--checkpoint", servers["qwen"].path, "--url", servers["qwen"].proc.url, "--api-key", KEY,
                            "--concurrency", "1", "3", "--requests", "4", "--prompt-len", "6", "--output-len", "3",
                            "--cb-block-size", "4", "--client-processes", "2", "--out", str(out)])
    assert [(r["target"], r["concurrency"]) for r in rows] == [("http", 1), ("http", 3), ("in-process", 1),
                                                                ("in-process", 3)]
    assert [r.get("client_processes") for r in rows[:2]] == [1, 2]  # concurrency 3: two client processes
    for row in rows:
        assert row["requests"] == 4 and row["output_tokens"] == 12 and row["failed"] == 0, row
        assert row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0 and row["output_tokens_per_s"] > 0
        # The engine's steps in the level (from /health's counters, or the manager's): every request's prompt
        # takes a prefill step or more, and its 3 tokens two decode steps (the first comes with the prefill).
        assert row["prefill_steps"] + row["grouped_steps"] >= 1 and row["decode_steps"] >= 2 and row["ms_per_step"] > 0, row
    assert rows[2]["http_over_in_process"] > 0
    assert [json.loads(line)["target"] for line in out.read_text().splitlines()] == [r["target"] for r in rows]


def test_shutdown_cancels_what_runs_and_exits_cleanly(servers):
    """SIGTERM with a stream in flight: the stream ends, the process exits 0 and its engine process is gone (run
    last: it stops a server)."""
    server = servers["inkling"]
    engine_pid = health(server)["engine_pid"]
    assert not gone(engine_pid)
    c = client(server)
    stream = c.completions.create(model="inkling-tiny", prompt="Go on", max_tokens=500, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices
    done = threading.Event()

    def drain():
        try:
            for _ in stream:
                pass
        except Exception:  # the connection closes under it
            pass
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    server.proc.process.send_signal(signal.SIGTERM)
    code = server.proc.process.wait(30)
    log = server.proc.output()
    # uvicorn ends a graceful shutdown by re-raising the signal it caught: -SIGTERM, not a crash's 1.
    assert code in (0, -signal.SIGTERM), log
    assert "cancelled 1 request(s) still running" in log and "the engine stopped" in log, log
    assert "Traceback" not in log, log
    assert done.wait(10)
    assert gone(engine_pid), f"the engine process {engine_pid} outlived the server"


def test_a_killed_engine_process_fails_what_runs_and_the_server_answers_503(servers):
    """The engine's process dies (SIGKILL) with a stream and a whole request in flight: the stream gets an error
    event, the whole request a 503; /health and new requests say the engine is dead (503); the server still
    stops at once (run last: it kills a server's engine)."""
    server = servers["image"]
    pid = health(server)["engine_pid"]
    body = {"model": "qwen-image-tiny", "prompt": "Go on", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(post, server, "/v1/completions", body)
        stream = client(server).completions.create(model=body["model"], prompt="Go on", max_tokens=300,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices
        deadline = time.monotonic() + 10
        while health(server)["rows_in_use"] < 2:  # both run
            assert time.monotonic() < deadline, health(server)
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine process was killed by SIGKILL"):
            for _ in stream:
                pass
        code, answer = whole.result(timeout=30)
    assert code == 503 and "killed by SIGKILL" in answer["error"]["message"], answer
    state = health(server)
    assert state["http_status"] == 503 and not state["running"] and "killed by SIGKILL" in state["fatal_error"]
    assert state["inflight"] == 0 and state["requests_failed"] >= 2
    code, answer = post(server, "/v1/completions", {**body, "max_tokens": 2})
    assert code == 503 and answer["error"]["code"] == "engine_unavailable", answer
    assert gone(pid)  # the server waited for it (no zombie)
    server.proc.process.send_signal(signal.SIGTERM)
    assert server.proc.process.wait(30) in (0, -signal.SIGTERM)
    assert "Traceback" not in server.proc.output()
