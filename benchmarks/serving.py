"""Serving throughput and latency: the server driven at increasing concurrency, beside the
in-process Engine on the same workload, in the same run.

    python benchmarks/serving.py                                   # default model, a short run
    python benchmarks/serving.py --concurrency 1 8 32 64 --rounds 4 --output-len 64 --output-dist longtail
    python benchmarks/serving.py --model DIR --dtype float32 --attention-backend torch   # any EngineConfig flag

The server is what `stemma serve` runs (engine and gateway processes; here on a private ipc
path, via stemma.Runtime), or an already running one given with --address. At concurrency C,
C clients (one connection each) run a closed loop: each streams `--rounds` requests one after the
other. The in-process Engine runs the same closed loop at --compare-at concurrency: it keeps that
many requests submitted and steps until all are done.

Workload: text prompts of `--prompt-words` random common words (seeded); greedy decoding with
ignore_eos, so every request generates exactly its output length. `uniform`: every output is
--output-len tokens. `longtail`: lengths are lognormal (median --output-len / 2, capped at
4 x --output-len), as real chat traffic is long-tailed.

Metrics, per request: TTFT is the time from sending (submitting) to the first token; ITL is the
mean gap between its later tokens, (last - first) / (tokens - 1). Percentiles are over requests;
throughput is generated tokens / wall time of the level. Served TTFT and ITL are measured by the
client, at text-delta granularity, so they include the gateway and the sockets.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import percentile, table  # noqa: E402

from stemma.cli_args import add_dataclass_args, collect  # noqa: E402
from stemma.engine_config import EngineConfig  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point number group problem fact river mountain city garden window story music dream "
         "light water stone forest letter morning friend history question answer market road bridge "
         "winter summer ocean island machine paper voice color").split()


@dataclass(frozen=True)
class Job:
    prompt: str
    max_new_tokens: int


@dataclass(frozen=True)
class Record:
    tokens: int
    ttft: float
    itl: float | None


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


def record(start: float, first: float | None, last: float, tokens: int) -> Record:
    first = first if first is not None else last
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return Record(tokens, first - start, itl)


# ---- served ----
async def served_client(client, jobs: list[Job], out: list[Record]) -> None:
    for job in jobs:
        start = time.perf_counter()
        first = None
        stream = client.astream(job.prompt, params(job))
        async for _ in stream:
            if first is None:
                first = time.perf_counter()
        out.append(record(start, first, time.perf_counter(), len(stream.output.token_ids)))


async def served_level(address: str, concurrency: int, jobs: list[Job]) -> tuple[float, list[Record]]:
    from stemma.client.sync import connect
    clients = [connect(address) for _ in range(concurrency)]
    out: list[Record] = []
    start = time.perf_counter()
    await asyncio.gather(*[served_client(c, jobs[i::concurrency], out) for i, c in enumerate(clients)])
    wall = time.perf_counter() - start
    for c in clients:
        c.close()
    return wall, out


# ---- in process ----
def inprocess_level(engine, concurrency: int, jobs: list[Job]) -> tuple[float, list[Record]]:
    queue, active, out = list(jobs), [], []
    start = time.perf_counter()
    while queue or active:
        while queue and len(active) < concurrency:
            job = queue.pop(0)
            active += engine.submit(job.prompt, params(job))
        engine.step()
        for req in [r for r in active if r.finished]:
            active.remove(req)
            out.append(record(req.arrival, req.first_token_time, req.finish_time, len(req.output_ids)))
    return time.perf_counter() - start, out


def row(mode: str, concurrency: int, wall: float, records: list[Record]) -> list[object]:
    tokens = sum(r.tokens for r in records)
    ttft = [r.ttft * 1e3 for r in records]
    itl = [r.itl * 1e3 for r in records if r.itl is not None]
    return [mode, concurrency, len(records), tokens, round(wall, 2), round(tokens / wall, 1),
            *(round(percentile(ttft, q), 1) for q in (50, 90, 99)),
            *(round(percentile(itl, q), 1) for q in (50, 90, 99))]


HEADERS = ["mode", "conc", "reqs", "tokens", "wall_s", "tok/s", "ttft_p50", "ttft_p90", "ttft_p99",
           "itl_p50", "itl_p90", "itl_p99"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", help="drive this running server instead of starting one")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--rounds", type=int, default=1, help="requests each client sends, one after another")
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=12)
    ap.add_argument("--output-dist", choices=("uniform", "longtail"), default="uniform")
    ap.add_argument("--compare-at", type=int, default=32, help="concurrency of the in-process comparison")
    ap.add_argument("--seed", type=int, default=0)
    add_dataclass_args(ap, EngineConfig)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    config = collect(args, EngineConfig)
    from stemma.engine.engine import Engine
    from stemma.serve.runtime import Runtime
    levels = sorted(set(args.concurrency) | {args.compare_at})
    runtime = None
    if args.address is None:
        t0 = time.perf_counter()
        runtime = Runtime(**config)
        print(f"server ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    address = args.address or runtime.address
    rows, served_tps = [], {}
    try:
        asyncio.run(served_level(address, 1, workload(1, args.prompt_words, 4, "uniform", -1)))  # warm-up
        for c in levels:
            jobs = workload(c * args.rounds, args.prompt_words, args.output_len, args.output_dist, args.seed + c)
            wall, records = asyncio.run(served_level(address, c, jobs))
            rows.append(row("served", c, wall, records))
            served_tps[c] = rows[-1][5]
            print(table(HEADERS, [rows[-1]]).splitlines()[-1], file=sys.stderr)
    finally:
        if runtime is not None:
            runtime.close()
    engine = Engine(**config)
    inprocess_level(engine, 1, workload(1, args.prompt_words, 4, "uniform", -1))  # warm-up
    c = args.compare_at
    jobs = workload(c * args.rounds, args.prompt_words, args.output_len, args.output_dist, args.seed + c)
    wall, records = inprocess_level(engine, c, jobs)
    rows.append(row("in-process", c, wall, records))
    lengths = (f"{args.output_len} tokens" if args.output_dist == "uniform"
               else f"median {args.output_len // 2}, max {4 * args.output_len} tokens")
    print(f"\nmodel: {config.get('model') or 'default (Gemma 3 270M Q4_K_M)'}; workload per level: "
          f"conc x {args.rounds} requests, {args.prompt_words}-word text prompts, {args.output_dist} "
          f"outputs ({lengths}, ignore_eos), greedy; times in ms")
    print(table(HEADERS, rows))
    print(f"server overhead at concurrency {c}: served / in-process throughput = "
          f"{served_tps[c] / rows[-1][5]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
