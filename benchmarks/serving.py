"""Serving throughput and latency over the two fronts of one server, HTTP (the OpenAI API) and
ZeroMQ (stemma's own protocol), at increasing concurrency, beside the in-process Engine on the
same workload, in the same run.

    python benchmarks/serving.py                                   # default model, 1 / 16 / 32
    python benchmarks/serving.py --concurrency 1 8 32 64 --rounds 4 --output-len 64 --output-dist longtail
    python benchmarks/serving.py --model DIR --dtype float32 --attention-backend torch   # any EngineConfig flag
    python benchmarks/serving.py --address tcp://HOST:30001 --url http://HOST:30000   # a running server

The server is what `stemma serve` runs: engine and gateway processes, the gateway serving HTTP
and ZeroMQ, both on free loopback TCP ports (stemma.serve.launch.ServerProcesses), so both fronts
drive the same engine. --address (ZeroMQ) and --url (HTTP) drive an already running server
instead; with only one of them given, only that front is measured. At concurrency C, C clients
(one connection each) run a closed loop: each streams `--rounds` requests one after the other.
ZeroMQ clients are stemma.connect's (astream); HTTP clients are the official `openai` package's
AsyncOpenAI (streamed /v1/completions with the same text prompt, max_tokens, temperature 0,
`ignore_eos` in extra_body, and stream_options.include_usage). The in-process Engine runs the
same closed loop at --compare-at concurrency, --repeats times, after the server has stopped: it
keeps that many requests submitted and steps until all are done.

Fairness: at each level, both fronts first warm up (one --output-len request per client, on the
connections that are then measured); then each front runs the level's same jobs --repeats times,
the order alternating (zmq, http, http, zmq, ...), the radix cache flushed before every run, so
that no run reuses another's prompts. A row sums its runs: throughput is their tokens over their
wall time, percentiles are over all their requests.

Workload: text prompts of `--prompt-words` random common words (seeded); greedy decoding with
ignore_eos, so every request generates exactly its output length (checked: each front counts the
tokens it was sent, ZeroMQ from the output's ids, HTTP from usage.completion_tokens). `uniform`:
every output is --output-len tokens. `longtail`: lengths are lognormal (median --output-len / 2,
capped at 4 x --output-len), as real chat traffic is long-tailed.

Metrics, per request: TTFT is the time from sending (submitting) to the first token (served: the
first non-empty text delta, or content chunk); ITL is the mean gap between its later tokens,
(last - first) / (tokens - 1). Served TTFT and ITL are measured by the client, at text-delta
granularity, so they include the gateway and the sockets. `prompt` is the prompt tokens the
server counted and `cached` those its radix cache served (the same work on both fronts);
`cli_cpu` is the cores this (client) process used during the run (in-process: the engine's),
`foreign` the cores used by processes outside this one and its children (other work on the
machine; a started server is a child, an external one is foreign).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CpuAudit, percentile, table  # noqa: E402

from stemma.cli_args import add_dataclass_args, collect  # noqa: E402
from stemma.engine_config import EngineConfig  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point number group problem fact river mountain city garden window story music dream "
         "light water stone forest letter morning friend history question answer market road bridge "
         "winter summer ocean island machine paper voice color").split()
START_TIMEOUT_S = 600.0
ACCEPT = 0.9  # HTTP must reach this fraction of ZeroMQ's throughput at --compare-at


@dataclass(frozen=True)
class Job:
    prompt: str
    max_new_tokens: int


@dataclass(frozen=True)
class Record:
    tokens: int
    ttft: float
    itl: float | None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Trial:
    wall: float
    records: list[Record]
    client_cpu: float   # CPU seconds of this process
    foreign_cpu: float  # CPU seconds of processes outside this tree


def workload(count: int, prompt_words: int, output_len: int, dist: str, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
        if dist == "uniform":
            n = output_len
        else:
            n = min(max(1, round(rng.lognormvariate(0.0, 1.0) * output_len / 2)), 4 * output_len)
        jobs.append(Job(prompt, n))
    return jobs


def params(job: Job) -> dict:
    return {"max_new_tokens": job.max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def record(start: float, first: float | None, last: float, tokens: int, prompt_tokens: int = 0,
           cached_tokens: int = 0) -> Record:
    first = first if first is not None else last
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return Record(tokens, first - start, itl, prompt_tokens, cached_tokens)


# ---- served over ZeroMQ ----
class ZmqFront:
    name = "zmq"

    def __init__(self, address: str, api_key: str | None):
        self.address, self.api_key = address, api_key

    async def prepare(self) -> None:
        pass

    def clients(self, n: int) -> list:
        from stemma.client.sync import connect
        return [connect(self.address, self.api_key) for _ in range(n)]

    async def drive(self, client, jobs: list[Job], out: list[Record]) -> None:
        for job in jobs:
            start = time.perf_counter()
            first = None
            stream = client.astream(job.prompt, params(job))
            async for _ in stream:
                if first is None:
                    first = time.perf_counter()
            output = stream.output
            out.append(record(start, first, time.perf_counter(), len(output.token_ids),
                              output.meta.get("prompt_tokens", 0), output.meta.get("cached_tokens", 0)))

    async def flush(self) -> bool:
        from stemma.client.sync import connect
        with connect(self.address, self.api_key) as client:
            return await client.aflush_cache()

    async def close(self, clients: list) -> None:
        for c in clients:
            c.close()


# ---- served over HTTP (the OpenAI API, with the openai package) ----
class HttpFront:
    name = "http"

    def __init__(self, url: str, api_key: str | None):
        self.url, self.api_key = url.rstrip("/"), api_key
        self.model: str | None = None

    def clients(self, n: int) -> list:
        try:
            from openai import AsyncOpenAI
        except ImportError:
            raise SystemExit("the HTTP front needs the openai package: pip install openai") from None
        return [AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0)
                for _ in range(n)]

    async def prepare(self) -> None:
        """Learns the model id the server serves."""
        (client,) = self.clients(1)
        self.model = (await client.models.list()).data[0].id
        await client.close()

    async def drive(self, client, jobs: list[Job], out: list[Record]) -> None:
        for job in jobs:
            start = time.perf_counter()
            first, usage = None, None
            stream = await client.completions.create(
                model=self.model, prompt=job.prompt, max_tokens=job.max_new_tokens, temperature=0.0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
            if usage is None:
                raise RuntimeError(f"{self.url} streamed no usage chunk")
            details = usage.prompt_tokens_details
            out.append(record(start, first, time.perf_counter(), usage.completion_tokens,
                              usage.prompt_tokens, (details and details.cached_tokens) or 0))

    async def flush(self) -> bool:
        return (await asyncio.to_thread(_post_json, self.url + "/flush_cache", self.api_key))["ok"]

    async def close(self, clients: list) -> None:
        await asyncio.gather(*(c.close() for c in clients))


def _post_json(url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, b"", headers, method="POST"), timeout=30) as r:
        return json.loads(r.read())


async def run_jobs(front, clients: list, jobs: list[Job]) -> Trial:
    out: list[Record] = []
    with CpuAudit() as audit:
        cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*[front.drive(c, jobs[i::len(clients)], out) for i, c in enumerate(clients)])
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Trial(wall, out, cpu, audit.foreign_cores * audit.wall)


async def flush(front, timeout: float = 30.0) -> None:
    """Empties the radix cache; it refuses while requests still run, so this retries."""
    deadline = time.monotonic() + timeout
    while not await front.flush():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not flush its cache within {timeout:g} s")
        await asyncio.sleep(0.05)


def check_tokens(front, c: int, jobs: list[Job], trial: Trial) -> None:
    want, got = sum(j.max_new_tokens for j in jobs), sum(r.tokens for r in trial.records)
    if got != want or len(trial.records) != len(jobs):
        print(f"warning: {front.name} at concurrency {c}: {len(trial.records)} requests, {got} tokens; "
              f"expected {len(jobs)}, {want} (ignore_eos not honoured?)", file=sys.stderr)


async def served(fronts: list, levels: list[int], args) -> dict[tuple[str, int], list[Trial]]:
    """Every front at every level: warm-up, then --repeats runs each, in alternating order."""
    trials: dict[tuple[str, int], list[Trial]] = defaultdict(list)
    for f in fronts:
        await f.prepare()
    for c in levels:
        jobs = workload(c * args.rounds, args.prompt_words, args.output_len, args.output_dist, args.seed + c)
        warm = workload(c, args.prompt_words, args.output_len, "uniform", -1 - c)
        clients = {f.name: f.clients(c) for f in fronts}
        try:
            for f in fronts:
                await run_jobs(f, clients[f.name], warm)
            for r in range(args.repeats):
                for f in (fronts if r % 2 == 0 else fronts[::-1]):
                    await flush(fronts[0])
                    trial = await run_jobs(f, clients[f.name], jobs)
                    check_tokens(f, c, jobs, trial)
                    trials[f.name, c].append(trial)
                    print(table(HEADERS, [row(f.name, c, [trial])]).splitlines()[-1], file=sys.stderr)
        finally:
            for f in fronts:
                await f.close(clients[f.name])
    return trials


# ---- the server ----
def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_http(procs, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        died = procs.exited()
        if died:
            raise RuntimeError(f"stemma server failed to start: {died}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout:g} s")
        time.sleep(0.1)


def start_server(config: dict):
    """`stemma serve` on free loopback ports: (its processes, the ZeroMQ address, the HTTP url)."""
    from stemma.serve.launch import ServeConfig, ServerProcesses
    port, zmq_port = free_ports(2)
    serve = ServeConfig(port=port, zmq_port=zmq_port)
    procs = ServerProcesses(EngineConfig.from_kwargs(**config), serve.address, http=serve)
    try:
        procs.wait_ready(START_TIMEOUT_S)
        wait_http(procs, serve.url, START_TIMEOUT_S)
    except BaseException:
        procs.stop()
        raise
    return procs, serve.address, serve.url


# ---- in process ----
def inprocess_level(engine, concurrency: int, jobs: list[Job]) -> Trial:
    queue, active, out = list(jobs), [], []
    with CpuAudit() as audit:
        cpu, start = time.process_time(), time.perf_counter()
        while queue or active:
            while queue and len(active) < concurrency:
                job = queue.pop(0)
                active += engine.submit(job.prompt, params(job))
            engine.step()
            for req in [r for r in active if r.finished]:
                active.remove(req)
                out.append(record(req.arrival, req.first_token_time, req.finish_time,
                                  len(req.output_ids), len(req.input_ids), req.cached_tokens))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Trial(wall, out, cpu, audit.foreign_cores * audit.wall)


# ---- report ----
def throughput(trials: list[Trial]) -> float:
    return sum(r.tokens for t in trials for r in t.records) / sum(t.wall for t in trials)


def row(mode: str, concurrency: int, trials: list[Trial]) -> list[object]:
    records = [r for t in trials for r in t.records]
    wall = sum(t.wall for t in trials)
    tokens = sum(r.tokens for r in records)
    ttft = [r.ttft * 1e3 for r in records]
    itl = [r.itl * 1e3 for r in records if r.itl is not None]
    return [mode, concurrency, len(records), tokens, sum(r.prompt_tokens for r in records),
            sum(r.cached_tokens for r in records), round(wall, 2), round(tokens / wall, 1),
            *(round(percentile(ttft, q), 1) for q in (50, 90, 99)),
            *(round(percentile(itl, q), 1) for q in (50, 90, 99)),
            round(sum(t.client_cpu for t in trials) / wall, 2),
            round(sum(t.foreign_cpu for t in trials) / wall, 2)]


HEADERS = ["front", "conc", "reqs", "tokens", "prompt", "cached", "wall_s", "tok/s", "ttft_p50", "ttft_p90",
           "ttft_p99", "itl_p50", "itl_p90", "itl_p99", "cli_cpu", "foreign"]


def ratios(trials: dict, levels: list[int], compare_at: int) -> list[str]:
    """HTTP / ZeroMQ throughput per level, then at compare_at with its per-run pairs."""
    if not any(k[0] == "http" for k in trials) or not any(k[0] == "zmq" for k in trials):
        return []
    per_level = ", ".join(f"{c}: {throughput(trials['http', c]) / throughput(trials['zmq', c]):.2f}"
                          for c in levels)
    c = compare_at
    pairs = [throughput([h]) / throughput([z]) for h, z in zip(trials["http", c], trials["zmq", c])]
    ratio = throughput(trials["http", c]) / throughput(trials["zmq", c])
    verdict = "ok" if ratio >= ACCEPT else "BELOW"
    return [f"HTTP / ZeroMQ throughput per concurrency: {per_level}",
            f"HTTP / ZeroMQ throughput at {c} = {ratio:.2f} (runs: {', '.join(f'{p:.2f}' for p in pairs)}; "
            f"acceptance >= {ACCEPT:.2f}: {verdict})"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", help="the ZeroMQ address (tcp://host:port) of a running server to drive "
                    "instead of starting one")
    ap.add_argument("--url", help="the HTTP address (http://host:port) of a running server to drive "
                    "instead of starting one")
    ap.add_argument("--api-key", help="the API key of the running server given by --address / --url")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--rounds", type=int, default=1, help="requests each client sends, one after another")
    ap.add_argument("--repeats", type=int, default=2,
                    help="measured runs of each front per level, in alternating order")
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=12)
    ap.add_argument("--output-dist", choices=("uniform", "longtail"), default="uniform")
    ap.add_argument("--compare-at", type=int, default=32,
                    help="concurrency of the in-process comparison and of the HTTP / ZeroMQ verdict")
    ap.add_argument("--seed", type=int, default=0)
    add_dataclass_args(ap, EngineConfig)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1 or min(args.concurrency) < 1 or args.compare_at < 1:
        ap.error("--repeats, --rounds, --concurrency and --compare-at must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    config = collect(args, EngineConfig)
    from stemma.engine.engine import Engine
    levels = sorted(set(args.concurrency) | {args.compare_at})
    procs, address, url = None, args.address, args.url
    if address is None and url is None:
        t0 = time.perf_counter()
        procs, address, url = start_server(config)
        print(f"server ready in {time.perf_counter() - t0:.1f}s: ZeroMQ {address}, HTTP {url}",
              file=sys.stderr)
    fronts = ([ZmqFront(address, args.api_key)] if address else []) + \
             ([HttpFront(url, args.api_key)] if url else [])
    try:
        trials = asyncio.run(served(fronts, levels, args))
    finally:
        if procs is not None:
            procs.stop()
    rows = [row(f.name, c, trials[f.name, c]) for c in levels for f in fronts]
    engine = Engine(**config)
    c = args.compare_at
    inprocess_level(engine, c, workload(c, args.prompt_words, args.output_len, "uniform", -1 - c))  # warm-up
    jobs = workload(c * args.rounds, args.prompt_words, args.output_len, args.output_dist, args.seed + c)
    inprocess = []
    for _ in range(args.repeats):
        engine.flush_cache()
        inprocess.append(inprocess_level(engine, c, jobs))
    rows.append(row("in-process", c, inprocess))
    lengths = (f"{args.output_len} tokens" if args.output_dist == "uniform"
               else f"median {args.output_len // 2}, max {4 * args.output_len} tokens")
    print(f"\nmodel: {config.get('model') or 'default (Gemma 3 270M Q4_K_M)'}; workload per level: "
          f"conc x {args.rounds} requests, {args.prompt_words}-word text prompts, {args.output_dist} "
          f"outputs ({lengths}, ignore_eos), greedy; {args.repeats} run(s) per front and level, "
          f"alternating; times in ms, cpu in cores")
    print(table(HEADERS, rows))
    overhead = ", ".join(f"{f.name} {throughput(trials[f.name, c]) / throughput(inprocess):.2f}"
                         for f in fronts)
    print(f"server overhead at concurrency {c}: served / in-process throughput = {overhead}")
    for line in ratios(trials, levels, c):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
