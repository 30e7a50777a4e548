"""The server's engine process without a process: what the child sends (`Outbox`: per-step deltas) and what the
server makes of it (`EngineProcess`: cumulative tokens, handlers, counts, checks before anything is sent).
A real child (started, killed, stopped) is tested through the HTTP server (tests/serving/test_http_server.py)."""

from __future__ import annotations

import pickle

import pytest
from transformers.generation.continuous_batching.requests import RequestStatus

pytest.importorskip("fastapi")

from hf_qsa_cache.server.engine import EngineDead  # noqa: E402
from hf_qsa_cache.server.engine_process import EngineProcess, EngineSettings, Outbox  # noqa: E402
from hf_qsa_cache.serving import Sampling  # noqa: E402
from hf_qsa_cache.serving.delivery import Delivery  # noqa: E402
from hf_qsa_cache.serving.requests import Request  # noqa: E402


class Pipe:
    """A pipe end that keeps what is sent (pickled, as the real one sends it)."""

    def __init__(self):
        self.sent: list = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(pickle.loads(data))


class Alive:
    pid = 1

    def is_alive(self) -> bool:
        return True


def engine() -> EngineProcess:
    from helpers.qwen4 import tiny_config

    process = EngineProcess(EngineSettings("unused"), tiny_config())
    process.process, process.conn = Alive(), Pipe()  # a child that is alive, a pipe that keeps what is sent
    return process


def test_the_child_sends_only_new_tokens_and_the_server_keeps_the_sum():
    """A streamed request's news, as the manager's delivery hands it to the child's delta handler (`Outbox.put`),
    goes out as deltas: a message carries the tokens since the previous one (two steps before a send merge into one
    delta); the server's handler sees the tokens so far, which equal the sum of the deltas."""
    outbox, delivery = Outbox(Pipe()), Delivery()
    a = Request("a", [5, 6], 7, frozenset([1]), want_logprobs=True, streaming=True)
    b = Request("b", [5, 6], 7, frozenset([1]), want_logprobs=True, streaming=True)
    for request in (a, b):
        delivery.register(request.request_id, outbox.put, deltas=True)
    full = [5, 9, 33, 2, 70, 8, 1]
    logprobs = [-0.5, -0.25, -1.5, -2.0, -0.1, -0.2, -0.3]

    def step(request, upto):  # the engine adds tokens and hands the request's news to its handler
        while len(request.generated) < upto:
            k = len(request.generated)
            request.add_token(full[k], logprobs[k])
        delivery.put(request)

    step(a, 1)
    b.add_token(7, -1.0)
    delivery.put(b)
    step1 = outbox.take(0)
    step(a, 2)
    step(a, 4)  # two steps before the sender looked: one delta
    step2 = outbox.take(0)
    step(a, 7)  # its eos: finished
    b.finish(RequestStatus.FAILED, "cancelled")
    delivery.put(b)
    step3 = outbox.take(0)
    assert outbox.take(0) == []
    assert step1 == [("results", [("a", [5], [-0.5], False, None), ("b", [7], [-1.0], False, None)])]
    assert step2 == [("results", [("a", [9, 33, 2], [-0.25, -1.5, -2.0], False, None)])]
    assert step3 == [("results", [("a", [70, 8, 1], [-0.1, -0.2, -0.3], True, None), ("b", [], [], True,
                                                                                         "cancelled")])]
    delivery.put(a)  # a request's handler is dropped with its final news
    assert outbox.take(0) == [] and delivery.get("a", timeout=0) is not None

    server = engine()
    seen = []
    rid = server.submit([5, 6], lambda result: seen.append((list(result.generated_tokens), result.is_finished(),
                                                            result.error)),
                        max_new_tokens=7, eos_token_id=[1], sampling=None, seed=None, logprobs=True, streaming=True)
    for message in step1 + step2 + step3:  # as the child's request "a"
        server.handle((message[0], [(rid if item[0] == "a" else "other", *item[1:]) for item in message[1]]))
    assert seen == [([5], False, None), ([5, 9, 33, 2], False, None), (full, True, None)]
    assert server.inflight == {} and server.counts["finished"] == 1


def test_a_result_after_a_cancel_reaches_no_handler():
    server = engine()
    seen = []
    rid = server.submit([5, 6], seen.append, max_new_tokens=4, eos_token_id=[1], sampling=None, seed=None,
                        logprobs=False, streaming=True)
    server.cancel(rid)
    server.handle(("results", [(rid, [3], [], True, "cancelled")]))
    assert seen == [] and server.counts["cancelled"] == 1 and server.counts["finished"] == 0
    assert server.conn.sent[-1] == ("cancel", rid)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": []}, "at least one prompt token"),
    ({"prompt": [5, 96]}, "token ids must lie in [0, 96)"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"sampling": "greedy"}, "sampling must be a hf_qsa_cache.serving.Sampling"),
    ({"logprobs": 1}, "logprobs must be True or False"),
    ({"media": {"pixel_values": [1.0]}}, "takes no media"),
])
def test_a_bad_value_raises_here_and_sends_nothing(kwargs, message):
    """The manager's own checks run in the server's process: a `ValueError` (the HTTP app's 400) and nothing sent
    to the child, as with the engine in process."""
    server = engine()
    args = {"prompt": [5, 6], "max_new_tokens": 4, "eos_token_id": [1], "sampling": Sampling(), "seed": 3,
            "logprobs": False, "media": None, **kwargs}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        server.submit(args.pop("prompt"), print, streaming=False, **args)
    assert server.conn.sent == [] and server.inflight == {} and server.counts["submitted"] == 0
    server.submit([5, 6], print, max_new_tokens=4, eos_token_id=[1], sampling=Sampling(), seed=3, logprobs=False,
                  streaming=False)
    assert [m[0] for m in server.conn.sent] == ["submit"] and server.counts["submitted"] == 1


def test_a_dead_child_fails_what_is_in_flight_and_refuses_more():
    server = engine()
    seen = []
    server.submit([5, 6], seen.append, max_new_tokens=4, eos_token_id=[1], sampling=None, seed=None,
                  logprobs=False, streaming=True)
    server.process = type("Killed", (), {"pid": 1, "exitcode": -9, "is_alive": lambda self: False,
                                         "join": lambda self, timeout=None: None})()
    server._lost()
    assert len(seen) == 1 and seen[0].is_finished() and seen[0].error == "the engine process was killed by SIGKILL"
    assert server.inflight == {} and server.counts["failed"] == 1
    with pytest.raises(EngineDead, match="killed by SIGKILL"):
        server.submit([5, 6], print, max_new_tokens=4, eos_token_id=[1], sampling=None, seed=None, logprobs=False,
                      streaming=True)


def test_a_checkpoint_the_child_cannot_load_is_an_engine_dead_naming_why(tmp_path):
    """The child loads the model (the server process reads only the config): a folder with a config and no
    weights fails there, and `start` says why (the command prints it and exits 1), leaving no process behind."""
    from helpers.qwen4 import tiny_config

    config = tiny_config()
    config.save_pretrained(tmp_path)
    server = EngineProcess(EngineSettings(str(tmp_path), torch_threads=1), config)
    with pytest.raises(EngineDead, match="the engine could not start: OSError: .*model"):
        server.start()
    assert server.process.exitcode == 1
    with pytest.raises(EngineDead):
        server.check_alive()


class StandInManager:
    """What `Engine` calls on a manager; its delta handlers are called by the test, as the engine thread would."""

    def __init__(self):
        self.handlers, self.cancelled = {}, []
        self.background_thread_status = type("Status", (), {"fatal_error": None})()

    def is_running(self) -> bool:
        return True

    def register_result_handler(self, request_id, callback, deltas=False):
        assert deltas  # no GenerationOutput is built per token for the server
        self.handlers[request_id] = callback

    def add_request(self, prompt, request_id, **options):
        pass

    def cancel_request(self, request_id):
        self.cancelled.append(request_id)


def test_the_in_process_engine_hands_every_requests_news_out_on_the_loop_at_once():
    """`Engine` (the engine in the server's process) takes deltas: news the engine thread leaves for several
    requests before the loop looks reaches each handler in one hand-out, on the loop's thread, as the tokens so far;
    a cancelled request's news reaches nobody."""
    import asyncio
    import threading

    from hf_qsa_cache.server.engine import Engine

    server = Engine(model=None)
    server.manager = StandInManager()
    seen: dict[str, list] = {}
    threads = set()

    def handler(result):
        threads.add(threading.get_ident())
        seen.setdefault(result.request_id, []).append((list(result.generated_tokens), result.is_finished()))

    async def run():
        ids = [server.submit([5, 6], handler, max_new_tokens=4, eos_token_id=[1], sampling=None, seed=None,
                             logprobs=False, streaming=True) for _ in range(3)]
        put = server.manager.handlers

        def engine_thread():  # two steps before the loop looks: one delta each, every request in one hand-out
            for rid, tokens in zip(ids, ([3], [4], [8])):
                put[rid](rid, tokens, [], False, None)
            put[ids[0]](ids[0], [9, 1], [], True, None)
            put[ids[1]](ids[1], [7], [], False, None)

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        await asyncio.sleep(0.05)
        server.cancel(ids[2])
        put[ids[2]](ids[2], [2], [], True, None)
        put[ids[1]](ids[1], [1], [], True, "boom")
        await asyncio.sleep(0.05)
        return ids, threading.get_ident()

    ids, loop_thread = asyncio.run(run())
    assert seen[ids[0]] == [([3, 9, 1], True)]
    assert seen[ids[1]] == [([4, 7], False), ([4, 7, 1], True)]
    assert seen[ids[2]] == [([8], False)]
    assert threads == {loop_thread}
    assert server.inflight == {} and server.manager.cancelled == [ids[2]]
    assert server.counts == {"submitted": 3, "finished": 1, "failed": 1, "cancelled": 1}
