"""The HTTP server's own work per streamed token (CPU): its routes, the engine process's server side, detokenizing
and the SSE chunks, under C streaming clients, with the engine's child replaced by a stand-in that answers every
request in flight with one new token a step, as fast as the server takes them (no model, no pipe, no process).

    python benchmarks/profile_server_stream.py --clients 64 --tokens 256
    python benchmarks/profile_server_stream.py --clients 64 --tokens 256 --profile

The clients are `httpx` streams over the ASGI transport in this process, so the figure (wall time over the
tokens streamed) also counts their reading of the chunks: an upper bound on the server's share. A server whose
event loop needs ``X`` us a token cannot stream more than ``1e6 / X`` tokens a second, however fast the engine;
at C streams, one engine step costs the loop ``C * X`` us.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (profile_serving_host's tiny configs)


class StandInChild:
    """What the engine process's child would send: each step, one token for every request in flight (and its
    end after ``tokens``), handed to `EngineProcess.handle` on the event loop."""

    def __init__(self, engine, tokens: int, vocab: int):
        self.engine, self.tokens, self.vocab = engine, tokens, vocab
        self.sent: dict[str, int] = {}
        self.steps = 0

    async def run(self, done: asyncio.Event) -> None:
        while not done.is_set():
            news = []
            for request_id in list(self.engine.inflight):
                n = self.sent.get(request_id, 0) + 1
                self.sent[request_id] = n
                news.append((request_id, [3 + (n * 7) % (self.vocab - 3)], [], n >= self.tokens, None))
            if news:
                self.engine.handle(("results", news))
                self.steps += 1
            await asyncio.sleep(0)  # the loop serves the clients between steps


class Alive:
    pid = 0

    def is_alive(self) -> bool:
        return True


class NoPipe:
    def send_bytes(self, data: bytes) -> None:  # submit and cancel messages: the stand-in reads `inflight`
        pass


def checkpoint(folder: str) -> str:
    """A tiny Qwen4Exp text checkpoint (the server loads only its config, generation config and tokenizer)."""
    import torch
    from profile_serving_host import tiny_config

    from hf_qsa_cache.server.toy import save_toy_checkpoint, toy_tokenizer
    from modeling import Qwen4ExpForCausalLM

    config = tiny_config("qwen4_exp", 2, 64, 4096)
    torch.manual_seed(0)
    return save_toy_checkpoint(folder, Qwen4ExpForCausalLM(config).eval(), toy_tokenizer(config.vocab_size))


async def stream(client, model: str, prompt: list[int], tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True, "temperature": 0}
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
    return chunks


async def level(app, served, clients: int, tokens: int) -> dict:
    try:  # the HTTP client the `openai` client brings (httpx2 for openai 3; httpx before)
        import httpx2 as httpx
    except ImportError:
        import httpx

    engine = served.engine
    engine.process, engine.conn = Alive(), NoPipe()
    child = StandInChild(engine, tokens, served.config.get_text_config().vocab_size)
    done = asyncio.Event()
    driver = asyncio.create_task(child.run(done))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://server", timeout=600) as client:
        start = time.perf_counter()
        chunks = await asyncio.gather(*(stream(client, served.name, [5, 6, 7, 8], tokens) for _ in range(clients)))
        wall = time.perf_counter() - start
    done.set()
    await driver
    streamed = clients * tokens
    return {"clients": clients, "tokens_per_client": tokens, "chunks": sum(chunks), "engine_steps": child.steps,
            "wall_s": round(wall, 3), "us_per_token": round(1e6 * wall / streamed, 1),
            "tokens_per_s": round(streamed / wall)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--profile", action="store_true", help="cProfile of the last level (top 25 by own time)")
    args = parser.parse_args(argv)

    from hf_qsa_cache.server.cli import build, parser as cli_parser

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = checkpoint(folder)
        for clients in args.clients:
            app, served = build(cli_parser().parse_args([path, "--max-tokens", str(args.tokens)]))
            profile = cProfile.Profile() if args.profile and clients == args.clients[-1] else None
            if profile is not None:
                profile.enable()
            row = asyncio.run(level(app, served, clients, args.tokens))
            if profile is not None:
                profile.disable()
            print(json.dumps(row), flush=True)
            rows.append(row)
            if profile is not None:
                pstats.Stats(profile).strip_dirs().sort_stats("tottime").print_stats(25)
    return rows


if __name__ == "__main__":
    main()
