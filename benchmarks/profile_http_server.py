"""The HTTP server's own cost per streamed token, on the CPU: a tiny checkpoint served from this process (its
event loop in the main thread, under cProfile), ``--streams`` streamed completions driven by a client process.

    python benchmarks/profile_http_server.py --streams 64 --tokens 64 --rounds 2

The server runs its engine in a process of its own, as `hf-qsa-serve` does: what is profiled is the server's
side alone (routes, detokenizing, JSON, sends, and reading the engine's pipe); the engine's process is not
profiled. With --engine-in-process the engine is a thread of this process, sharing the interpreter lock with the
event loop (whatever the loop spends per token and stream then lengthens the engine's steps: on the GPU, 19 ms
against 7.7 ms a step at 64 streams, benchmarks/RESULTS.md "HTTP server"); cProfile still sees only the main
thread. Reported: the client's wall time per round, the Python function calls the server's main thread (its
event loop) makes per streamed token, and cProfile's top entries.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

CLIENT = textwrap.dedent("""
    import asyncio, sys, time, openai
    url, model, streams, tokens, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    async def one(client, i):
        stream = await client.completions.create(model=model, prompt=[5 + i % 50, 6, 7, 8], max_tokens=tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            pass
    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for _ in range(rounds):
            start = time.perf_counter()
            await asyncio.gather(*(one(client, i) for i in range(streams)))
            print(f"round: {time.perf_counter() - start:.3f} s", flush=True)
    asyncio.run(main())
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8199)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--engine-in-process", action="store_true",
                        help="the engine as a thread of this process (default: a process of its own)")
    args = parser.parse_args()

    import torch
    import uvicorn

    from hf_qsa_cache.server.cli import build, parser as server_parser
    from helpers.http_server import qwen4_exp_text

    torch.set_num_threads(1)
    folder = tempfile.TemporaryDirectory()
    path = qwen4_exp_text(os.path.join(folder.name, "tiny"))
    server_args = server_parser().parse_args([path, "--port", str(args.port), "--cb-max-requests", str(args.streams),
                                              "--cb-block-size", "4", "--max-tokens", str(args.tokens)]
                                             + (["--engine-in-process"] if args.engine_in_process else []))
    app, served = build(server_args)
    served.engine.start()  # the model loads before profiling (the app's startup then attaches it to its loop)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning"))
    url = f"http://127.0.0.1:{args.port}"

    def drive():
        while not server.started:
            time.sleep(0.05)
        subprocess.run([sys.executable, "-c", CLIENT, url, served.name, str(args.streams), str(args.tokens),
                        str(args.rounds)], check=True)
        server.should_exit = True

    threading.Thread(target=drive, daemon=True).start()
    profile = cProfile.Profile()
    profile.enable()
    server.run()
    profile.disable()
    stats = pstats.Stats(profile)
    tokens = args.streams * args.tokens * args.rounds
    # Calls, not seconds: under uvloop the loop's idle wait is not told apart from its work.
    print(f"event loop: {stats.total_calls / tokens:.0f} Python function calls per streamed token ({tokens} tokens, "
          f"engine {served.engine.kind})")
    stats.strip_dirs().sort_stats("tottime").print_stats(args.top)
    folder.cleanup()


if __name__ == "__main__":
    main()
