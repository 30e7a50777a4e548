"""The HTTP server under load, side by side with our in-process engine on the same workload (and, optionally,
with `transformers serve` on transformers' own classes).

    python benchmarks/bench_http.py --model qwen4_exp --layers 40 --concurrency 1 8 64
    python benchmarks/bench_http.py --model inkling --layers 6 --concurrency 1 8 64 --transformers-serve

A random checkpoint at the benchmark shapes (`bench_generate`'s configs, bf16) is saved with a character
tokenizer, unless --checkpoint names one. Each level keeps ``C`` requests in flight (closed loop) until
--requests (default 4 x C, at least 16) are done: random prompts of --prompt-len tokens, --output-len new tokens
each (no eos), greedy. Measured per level and target: output tokens/s, TTFT and TPOT (p50 / p99).

* ``http``: `hf-qsa-serve` started here (or --url), streamed `/v1/completions` through the `openai` client; its
  engine in a process of its own (the command's default; ``engine: "process"`` in the JSON line), or with
  --engine-in-process in the server's process (``engine: "in-process"``);
* ``in-process``: `init_continuous_batching` in this process, `add_request` from C threads, the token times
  the engine records (the same cache configuration as the server's);
* ``transformers serve``: transformers' server on its own classes (sequential generate for these families),
  text prompts (its completions route takes no token ids), under --upstream-limit seconds per level.

Each result is a JSON line appended to --out (default ``benchmarks/results/http.jsonl``), key
``bench: "http"``; ``http_over_in_process`` is the throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
from percentiles import pct

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def summary(rows: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in rows if r["ttft"] is not None]
    tpot = [r["tpot"] for r in rows if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in rows)
    return {"requests": len(rows), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
            "ttft_p50_ms": _ms(pct(ttft, 0.5)), "ttft_p99_ms": _ms(pct(ttft, 0.99)),
            "tpot_p50_ms": _ms(pct(tpot, 0.5)), "tpot_p99_ms": _ms(pct(tpot, 0.99)),
            "failed": sum(1 for r in rows if r.get("error"))}


def _ms(value):
    return None if value is None else round(1000 * value, 3)


# ----------------------------------------------------------------------------- HTTP load
async def http_level(url: str, model: str, prompts, concurrency: int, output_len: int, api_key: str | None,
                     as_text=None, limit_s: float | None = None, ours: bool = True) -> tuple[list[dict], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=0, timeout=3600)
    queue = list(enumerate(prompts))
    rows: list[dict] = []
    start = time.perf_counter()

    async def one(prompt):
        sent = time.perf_counter()
        first = last = None
        tokens = 0
        extra = {"ignore_eos": True, "return_token_ids": True} if ours else {}
        try:
            stream = await client.completions.create(model=model, prompt=as_text(prompt) if as_text else prompt,
                                                     max_tokens=output_len, temperature=0, stream=True,
                                                     extra_body=extra)
            async for chunk in stream:
                for choice in chunk.choices:
                    got = len(getattr(choice, "token_ids", None) or []) if ours else (1 if choice.text else 0)
                    if got:
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        tokens += got
            error = None
        except Exception as e:  # a failed request is counted, not fatal
            error = f"{type(e).__name__}: {e}"
        tpot = (last - first) / (tokens - 1) if tokens > 1 else None
        return {"ttft": None if first is None else first - sent, "tpot": tpot, "tokens": tokens, "error": error}

    async def worker():
        while queue:
            if limit_s is not None and time.perf_counter() - start > limit_s:
                return
            _, prompt = queue.pop(0)
            rows.append(await one(prompt))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return rows, time.perf_counter() - start


def _client_process(job) -> tuple[list[dict], float, float]:
    """One client process: its share of a level (own event loop, own client); (rows, start, end) in wall time.
    It starts sending once every client process is up (``barrier``): the pool's processes come up one by one,
    seconds apart (each imports torch and openai), and a level timed from the first start to the last end would
    count that stagger as serving time."""
    url, model, prompts, concurrency, output_len, api_key, barrier = job
    import openai  # noqa: F401  (imported before the barrier: not part of the level's time)

    barrier.wait()
    start = time.time()
    rows, _ = asyncio.run(http_level(url, model, prompts, concurrency, output_len, api_key))
    return rows, start, time.time()


def http_level_processes(url: str, model: str, prompts, concurrency: int, output_len: int, api_key: str | None,
                         processes: int) -> tuple[list[dict], float]:
    """A level driven by ``processes`` client processes (the `openai` client parses every streamed chunk in
    Python: one process would measure itself at high concurrency), each keeping its share of the ``concurrency``
    requests in flight; the level's wall time runs from the first start to the last end."""
    processes = max(1, min(processes, concurrency))
    if processes == 1:
        return asyncio.run(http_level(url, model, prompts, concurrency, output_len, api_key))
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Manager() as shared, context.Pool(processes) as pool:
        barrier = shared.Barrier(processes)  # one job a process: each job waits there until all have started
        jobs = [(url, model, prompts[k::processes], len(range(k, concurrency, processes)), output_len, api_key,
                 barrier) for k in range(processes)]
        parts = pool.map(_client_process, jobs, chunksize=1)
    rows = [row for part, _, _ in parts for row in part]
    return rows, max(end for _, _, end in parts) - min(start for _, start, _ in parts)


# ----------------------------------------------------------------------------- in-process engine
def in_process_level(manager, prompts, concurrency: int, output_len: int) -> tuple[list[dict], float]:
    todo = list(prompts)
    lock = threading.Lock()
    rows: list[dict] = []
    start = time.perf_counter()

    def worker(k):
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop(0)
            sent = time.perf_counter()
            rid = manager.add_request(prompt, max_new_tokens=output_len, eos_token_id=[], record_timestamps=True)
            result = None
            while result is None or not result.is_finished():
                result = manager.get_result(request_id=rid, timeout=600)
            stamps = result.timestamps or []
            n = len(result.generated_tokens)
            rows.append({"ttft": stamps[0] - sent if stamps else None,
                         "tpot": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 and len(stamps) == n else None,
                         "tokens": n, "error": result.error})

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows, time.perf_counter() - start


# ----------------------------------------------------------------------------- setup
def make_checkpoint(args, folder: str) -> str:
    from bench_generate import inkling_config, qwen4_exp_config

    from hf_qsa_cache.server.toy import save_toy_checkpoint, toy_tokenizer

    config = (qwen4_exp_config if args.model == "qwen4_exp" else inkling_config)(args.layers)
    if args.model == "qwen4_exp":
        from modeling import Qwen4ExpForCausalLM as cls
    else:
        from modeling import InklingForCausalLM as cls
    torch.manual_seed(args.seed)
    model = cls(config).to(torch.bfloat16).eval()
    return save_toy_checkpoint(folder, model, toy_tokenizer(config.vocab_size))


def wait_up(url: str, process, timeout: float = 900) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not come up")


def server_health(url: str) -> dict:
    """The server's /health body (an unhealthy server's too)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:  # unhealthy: its body says the same
        return json.loads(error.read() or b"{}")


STEP_COUNTS = ("prefill_steps", "decode_steps", "grouped_steps", "preemptions")


def steps_taken(before: dict, after: dict, wall: float) -> dict:
    """What the engine did during a level (its counters' growth), and the wall time per step: whether a slower
    target ran more steps (scheduling: more, smaller prefill steps between decode steps) or slower ones."""
    row = {name: after.get(name, 0) - before.get(name, 0) for name in STEP_COUNTS}
    steps = row["prefill_steps"] + row["decode_steps"] + row["grouped_steps"]
    row["ms_per_step"] = round(1000 * wall / steps, 3) if steps else None
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--checkpoint", default=None, help="serve this checkpoint instead of a random one")
    p.add_argument("--url", default=None, help="a server already running on --checkpoint (none is started)")
    p.add_argument("--model-name", default=None, help="the served model's name (default: the folder's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--requests", type=int, default=None, help="requests per level (default 4 x C, at least 16)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--cb-block-size", type=int, default=64)
    p.add_argument("--cb-max-batch-tokens", type=int, default=8192)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--engine-in-process", action="store_true",
                   help="start the server with --engine-in-process (its engine a thread of the server's process)")
    p.add_argument("--no-in-process", action="store_true")
    p.add_argument("--transformers-serve", action="store_true", help="also run transformers serve on its classes")
    p.add_argument("--upstream-limit", type=float, default=300.0)
    p.add_argument("--client-processes", type=int, default=8,
                   help="client processes sharing each level's requests (at most its concurrency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "http.jsonl"))
    args = p.parse_args(argv)

    from transformers import AutoTokenizer, ContinuousBatchingConfig

    from hf_qsa_cache.server.loading import default_model_name, load
    from hf_qsa_cache.server.toy import CHARACTERS

    tmp = tempfile.TemporaryDirectory()
    path = args.checkpoint or make_checkpoint(args, os.path.join(tmp.name, f"{args.model}-{args.layers}"))
    name = args.model_name or default_model_name(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    char_ids = sorted(tokenizer.convert_tokens_to_ids(list(CHARACTERS)))
    rows_max = max(args.concurrency)
    cb = ContinuousBatchingConfig(block_size=args.cb_block_size, max_batch_tokens=args.cb_max_batch_tokens,
                                  max_requests_per_batch=rows_max)
    results: list[dict] = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    base = {"bench": "http", "model": args.model, "layers": args.layers, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
            else "cpu"}

    def record(row: dict) -> None:
        row = {**base, **row}
        results.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    def levels():
        for c in args.concurrency:
            count = args.requests or max(16, 4 * c)
            gen = torch.Generator().manual_seed(args.seed + c)
            yield c, [[char_ids[i] for i in torch.randint(0, len(char_ids), (args.prompt_len,), generator=gen)]
                      for _ in range(count)]

    # Our server (started here unless --url).
    server = None
    url = args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        command = [sys.executable, "-m", "hf_qsa_cache.serve", path, "--port", str(args.port),
                   "--cb-block-size", str(args.cb_block_size), "--cb-max-batch-tokens", str(args.cb_max_batch_tokens),
                   "--cb-max-requests", str(rows_max), "--max-tokens", str(args.output_len),
                   "--max-prompt-tokens", str(args.prompt_len + 1)]
        command += ["--engine-in-process"] if args.engine_in_process else []
        server = subprocess.Popen(command + (["--api-key", args.api_key] if args.api_key else []))
    try:
        wait_up(url, server)
        engine = server_health(url).get("engine")  # where the server runs it: "process" or "in-process"
        for c, prompts in levels():
            procs = args.client_processes
            http_level_processes(url, name, prompts[: min(len(prompts), c)], c, args.output_len, args.api_key, procs)
            before = server_health(url)
            rows, wall = http_level_processes(url, name, prompts, c, args.output_len, args.api_key, procs)
            record({"target": "http", "engine": engine, "concurrency": c, "client_processes": min(procs, c),
                    **summary(rows, wall), **steps_taken(before, server_health(url), wall)})
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)

    # Our engine in this process, the same cache configuration.
    if not args.no_in_process:
        model, _ = load(path)
        manager = model.init_continuous_batching(generation_config=model.generation_config,
                                                 continuous_batching_config=cb)
        manager.start()
        try:
            for c, prompts in levels():
                in_process_level(manager, prompts[: min(len(prompts), c)], c, args.output_len)  # warm-up
                before = dict(manager.stats)
                rows, wall = in_process_level(manager, prompts, c, args.output_len)
                row = {"target": "in-process", "concurrency": c, **summary(rows, wall),
                       **steps_taken(before, manager.stats, wall)}
                http = next((r for r in results if r["target"] == "http" and r["concurrency"] == c), None)
                if http and row["output_tokens_per_s"]:
                    row["http_over_in_process"] = round(http["output_tokens_per_s"] / row["output_tokens_per_s"], 3)
                record(row)
        finally:
            manager.stop(block=True, timeout=10)
        del model, manager

    # transformers serve on transformers' classes (text prompts: its completions route takes strings only).
    if args.transformers_serve:
        port = args.port + 1
        upstream = subprocess.Popen(["transformers", "serve", path, "--port", str(port)])
        try:
            wait_up(f"http://localhost:{port}", upstream)
            for c, prompts in levels():
                rows, wall = asyncio.run(http_level(
                    f"http://localhost:{port}", path, prompts, c, args.output_len, None,
                    as_text=lambda ids: tokenizer.decode(ids), limit_s=args.upstream_limit, ours=False))
                record({"target": "transformers serve", "concurrency": c, "time_limited": len(rows) < len(prompts),
                        **summary(rows, wall)})
        finally:
            upstream.terminate()
            upstream.wait(60)
    tmp.cleanup()
    return results


if __name__ == "__main__":
    main()
