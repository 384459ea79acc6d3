"""Latency and throughput of stemma's server beside llama.cpp's llama-server, same GGUF, same run.

    python benchmarks/latency.py                                   # all scenarios, 2 rounds
    python benchmarks/latency.py --scenarios single conc4 --rounds 3
    python benchmarks/latency.py --stemma-options kv_pool_tokens=32768 batching=continuous
    python benchmarks/latency.py --scenarios single --prompt-len 4000   # a long context

Both sides are servers driven over their own wire by one asyncio client process: stemma through
stemma.Runtime (engine + gateway processes, a private ipc path; `client.astream`, one client
connection per concurrent request), llama.cpp through llama-server's HTTP `/completion` with
`"stream": true` (one TCP connection per request; see benchmarks/llamacpp.py for its build). Every
request is greedy (temperature 0) with EOS ignored, so each generates exactly its length; both
sides get the same prompt token ids (stemma's tokenizer, BOS included), fresh ones for every
round and side-warm-up, so no prompt is ever served from a prefix cache.

Scenarios (each: a warm-up of both sides, then `--rounds` rounds of stemma, llama.cpp, stemma,
llama.cpp, ...; a table of the per-round medians). stemma's warm-up lets its decode compile
settle (compile_decode=auto compiles on a background thread): after the single stream's, until
the one-row graph is compiled; in the others, one unmeasured round of the scenario, a wait while
the graphs of the batch sizes it met compile, again until a round meets no new batch size:
  single    one request at a time (--single-requests of them): a --prompt-len-token prompt,
            --new-tokens new tokens. Decode tok/s = (tokens - 1) / (last - first token); TTFT.
  conc4     4 such requests at once; llama-server runs with -np 4.
  conc16    16 at once; -np 16. Generated tok/s = all tokens / wall; ITL = the gaps between
            the streamed events of a request, pooled over requests (p50, p99).
  batch64   64 requests at once, benchmarks/batching.py's mixed-longtail workload: random-token
            prompts of 16-64 tokens, outputs lognormal in [8, 128] (median ~22); stemma admits
            all 64; llama-server is measured at each -np of --batch-parallel (16 32 64) in every
            round (more slots than requests queue the rest), and its column is the -np whose
            median tok/s was best in this run (issue 12 compares with llama.cpp's best -np).

Tokens are counted from the stream, not from text: stemma's `stream.token_ids`, llama.cpp's
`tokens_predicted` (each streamed event carries one token). A token whose text is held back (an
incomplete UTF-8 character) arrives with the next event. An event of k tokens (a verify step of
speculative decoding) counts as one gap, the wait a reader sees; zero gaps for its other tokens
would pull the percentiles of a side that streams several tokens an event down. llama.cpp's own timings (the final event's `timings`) and stemma's own TTFT
(the output's meta) are shown beside the client's measurements.

The machine must be otherwise idle: with 2 threads on 2 cores, llama.cpp's spinning thread pool
slows down several-fold when any other process wants a core. Each round reports the CPU that
processes other than the benchmark's client and the server being measured used meanwhile (the
other server counts: stemma's decode compile runs in the background, and it took the cores from
llama.cpp's rounds until these counted it); each measurement first waits (--idle-wait) for all
of them, both servers included, to go quiet, a round during which they used
more than 0.2 cores is measured again (--disturbed-retries), and the tables leave such rounds out
when a quiet one exists.
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import gc
import json
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402
from batching import workload as batching_workload  # noqa: E402
from common import CpuAudit, percentile, table  # noqa: E402

SCENARIOS = ("single", "conc4", "conc16", "batch64")
CONCURRENCY = {"conc4": 4, "conc16": 16}
WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point number group problem fact river mountain city garden window story music dream "
         "light water stone forest letter morning friend history question answer market road bridge "
         "winter summer ocean island machine paper voice color").split()
DISTURBED_CORES = 0.2  # a round during which other processes used more is measured again
SLOT_CTX = 512  # llama-server KV tokens per slot, at least: -c = parallel x slot_ctx(args)


def slot_ctx(args) -> int:
    """KV tokens per llama-server slot: SLOT_CTX, or a longer prompt and its new tokens."""
    return max(SLOT_CTX, args.prompt_len + args.new_tokens + 64)


@dataclass(frozen=True)
class Job:
    ids: list[int]
    max_new: int


@dataclass
class Trace:
    """What the client saw of one request."""
    sent: float
    events: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens so far)
    tokens: int = 0
    server_ttft: float | None = None      # the server's own TTFT, seconds (stemma: meta; llama.cpp: prompt_ms)
    server_decode_tps: float | None = None  # llama.cpp's predicted_per_second
    cached: int = 0                       # prompt tokens the server took from its prefix cache

    def add(self, now: float, total: int) -> None:
        if total > (self.events[-1][1] if self.events else 0):
            self.events.append((now, total))

    @property
    def ttft(self) -> float:
        return self.events[0][0] - self.sent

    @property
    def decode_tps(self) -> float:
        (t0, n0), (t1, n1) = self.events[0], self.events[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else float("nan")

    def gaps(self) -> list[float]:
        """One gap per streamed event after the first (module docstring)."""
        return [t1 - t0 for (t0, _), (t1, _) in zip(self.events, self.events[1:])]


# ---- the two sides ----
class StemmaSide:
    name = "stemma"

    def __init__(self, options: dict):
        from stemma.serve.runtime import Runtime
        t0 = time.perf_counter()
        self.runtime = Runtime(**options)
        self.startup_s = time.perf_counter() - t0
        self.clients: list = []

    def _clients(self, n: int) -> list:
        from stemma.client.sync import connect
        while len(self.clients) < n:
            self.clients.append(connect(self.runtime.address))
        return self.clients[:n]

    async def one(self, client, job: Job) -> Trace:
        params = {"max_new_tokens": job.max_new, "temperature": 0.0, "ignore_eos": True}
        trace = Trace(time.perf_counter())
        stream = client.astream(job.ids, params)
        async for _ in stream:
            trace.add(time.perf_counter(), len(stream.token_ids))
        out = stream.output
        trace.add(time.perf_counter(), len(out.token_ids))
        trace.tokens = len(out.token_ids)
        trace.server_ttft = out.meta.get("ttft")
        trace.cached = out.meta.get("cached_tokens") or 0
        return trace

    async def run(self, jobs: list[Job], concurrent: bool) -> tuple[float, list[Trace]]:
        clients = self._clients(len(jobs) if concurrent else 1)
        t0 = time.perf_counter()
        if concurrent:
            traces = await asyncio.gather(*[self.one(c, j) for c, j in zip(clients, jobs)])
        else:
            traces = [await self.one(clients[0], j) for j in jobs]
        return time.perf_counter() - t0, list(traces)

    @property
    def pids(self) -> tuple[int, ...]:
        return (self.runtime.pid,)

    def compile_state(self) -> str:
        return str(self._clients(1)[0].info()["stats"].get("compiled_decode", "off"))

    async def settle_compile(self, prompts: Prompts, args, limit_s: float = 300.0) -> None:
        """Single-stream requests until the engine has compiled its one-row decode forward
        (compile_decode=auto compiles on a background thread after 128 decode or verify
        forwards, in the time the steps leave idle), then a wait for the compile, so that no
        round pays for it. Its trial (8 timed plain one-row decodes each way) may then run on in
        the rounds: a speculating stream has few of them."""
        t0 = time.perf_counter()
        while self.compile_state() in ("waiting", "compiling") and time.perf_counter() - t0 < limit_s:
            await self.run([Job(prompts.ids(), args.new_tokens)], concurrent=False)
            await self.wait_compiles(t0 + limit_s)
        print(f"stemma's compiled decode: {self.compile_state()} (after {time.perf_counter() - t0:.0f} s of "
              f"single-stream warm-up)", file=sys.stderr, flush=True)

    def compile_work(self) -> tuple[str, str, str]:
        """(phase, the one-request graph's state, the batch buckets' states) of the engine's compiles."""
        stats = self._clients(1)[0].info()["stats"]
        return (str(stats.get("compiled_decode_phase", "off")), str(stats.get("compiled_decode", "off")),
                str(stats.get("compiled_decode_batched", "off")))

    async def wait_compiles(self, deadline: float) -> None:
        """Until the engine's compile work is done (or `deadline`, perf_counter seconds), sending
        nothing: the compile thread runs in the time the steps leave idle."""
        while self.compile_work()[0] == "compiling" and time.perf_counter() < deadline:
            await asyncio.sleep(0.5)

    async def settle_batched(self, jobs: list[Job], concurrent: bool, limit_s: float = 600.0) -> None:
        """Unmeasured rounds of the scenario's own jobs until one meets no bucket of batch sizes
        whose decode graph was not already compiled (compile_decode=auto: it starts after 128
        decode forwards, then compiles each bucket met, on a background thread), each followed by
        a wait for the compiles: no measured round pays for a compile. The trials of the last
        graphs may run on in the measured rounds."""
        def met(work: tuple[str, str, str]) -> tuple[bool, list[str]]:  # the buckets queued so far
            return work[1] != "waiting", [b.split(":")[0] for b in work[2].split()]

        t0 = time.perf_counter()
        rounds = 0
        while time.perf_counter() - t0 < limit_s:
            before = self.compile_work()
            await self.run(jobs, concurrent)
            rounds += 1
            await self.wait_compiles(t0 + limit_s)
            after = self.compile_work()
            if before[0] in ("off", "failed") or (before[0] == "idle" and met(before) == met(after)):
                break  # no compile to come, or none queued by a round that began after the start
        phase, one, batched = self.compile_work()
        rows = self._clients(1)[0].info()["stats"].get("compiled_rows", "off")
        print(f"stemma's compiled decode: {phase}; one request {one}; batches {batched or '-'}; row ops {rows} "
              f"(settled in {rounds} rounds, {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.runtime.close()


class LlamaSide:
    name = "llama.cpp"

    def __init__(self, binary: Path, gguf: Path, threads: int, slot_ctx: int, extra_args: list[str] = ()):
        self.binary, self.gguf, self.threads, self.extra_args = binary, gguf, threads, list(extra_args)
        self.slot_ctx = slot_ctx
        self.server: llamacpp.LlamaServer | None = None

    def serve(self, parallel: int) -> None:
        if self.server is not None and self.server.parallel == parallel:
            return
        self.stop()
        self.server = llamacpp.start_server(self.gguf, self.threads, parallel, parallel * self.slot_ctx,
                                            binary=self.binary, extra_args=self.extra_args)

    async def one(self, job: Job) -> Trace:
        body = json.dumps({"prompt": job.ids, "n_predict": job.max_new, "stream": True, "ignore_eos": True,
                           "temperature": 0.0, "cache_prompt": True}).encode()
        trace = Trace(time.perf_counter())
        reader, writer = await asyncio.open_connection(self.server.host, self.server.port)
        try:
            writer.write(b"POST /completion HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                         % (self.server.host.encode(), self.server.port, len(body), body))
            await writer.drain()
            status = await reader.readline()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip().lower()
            chunked = headers.get("transfer-encoding") == "chunked"
            buf, counted = b"", 0
            while True:
                if chunked:
                    size = int((await reader.readline()).split(b";")[0], 16)
                    if size == 0:
                        break
                    data = await reader.readexactly(size)
                    await reader.readexactly(2)
                else:
                    data = await reader.read(65536)
                    if not data:
                        break
                buf += data
                now = time.perf_counter()
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if b" 200" not in status or "error" in ev:
                        raise RuntimeError(f"llama-server: {status!r} {ev}")
                    counted += len(ev.get("tokens") or [])
                    trace.add(now, ev.get("tokens_predicted", counted))
                    if ev.get("stop"):
                        t = ev.get("timings") or {}
                        trace.tokens = ev.get("tokens_predicted", counted)
                        trace.server_ttft = t["prompt_ms"] / 1e3 if "prompt_ms" in t else None
                        trace.server_decode_tps = t.get("predicted_per_second")
                        trace.cached = t.get("cache_n") or 0
            if b" 200" not in status:
                raise RuntimeError(f"llama-server: {status!r}")
        finally:
            writer.close()
        if trace.tokens == 0:
            trace.tokens = trace.events[-1][1] if trace.events else 0
        return trace

    async def run(self, jobs: list[Job], concurrent: bool) -> tuple[float, list[Trace]]:
        t0 = time.perf_counter()
        if concurrent:
            traces = await asyncio.gather(*[self.one(j) for j in jobs])
        else:
            traces = [await self.one(j) for j in jobs]
        return time.perf_counter() - t0, list(traces)

    @property
    def pids(self) -> tuple[int, ...]:
        return (self.server.proc.pid,) if self.server is not None else ()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


# ---- workloads ----
class Prompts:
    """Text prompts of exactly `length` tokens (stemma's tokenizer, BOS first), never repeated."""

    def __init__(self, tokenizer, length: int, seed: int):
        self.tok, self.length = tokenizer, length
        self.rng = random.Random(seed)

    def ids(self) -> list[int]:
        while True:
            text = " ".join(self.rng.choice(WORDS) for _ in range(self.length * 2)).capitalize()
            ids = self.tok(text)["input_ids"]
            if len(ids) >= self.length:
                return list(ids[:self.length])


def jobs_for(scenario: str, prompts: Prompts, args, seed: int) -> list[Job]:
    if scenario == "single":
        return [Job(prompts.ids(), args.new_tokens) for _ in range(args.single_requests)]
    if scenario in CONCURRENCY:
        return [Job(prompts.ids(), args.new_tokens) for _ in range(CONCURRENCY[scenario])]
    if scenario == "batch64":  # the same lengths every round (args.seed's draw), fresh tokens
        base = [Job(ids, n) for ids, n in batching_workload("mixed-longtail", args.batch_requests, seed=args.seed)]
        return fresh_like(base, None, seed)
    raise ValueError(scenario)


def fresh_like(jobs: list[Job], prompts: Prompts | None, seed: int) -> list[Job]:
    """The same lengths, new prompt tokens: text prompts from `prompts`, else random token ids
    (10-30000, as benchmarks/batching.py draws them)."""
    rng = random.Random(seed)
    return [Job(prompts.ids() if prompts is not None else [rng.randrange(10, 30000) for _ in j.ids], j.max_new)
            for j in jobs]


def warmup_jobs(scenario: str, prompts: Prompts, args) -> list[Job]:
    n = {"single": 1, "batch64": 16}.get(scenario, CONCURRENCY.get(scenario, 1))
    return [Job(prompts.ids(), 8) for _ in range(n)]


# ---- metrics ----
def measure(scenario: str, wall: float, traces: list[Trace]) -> dict[str, float]:
    tokens = sum(t.tokens for t in traces)
    ttft = [t.ttft * 1e3 for t in traces]
    server_ttft = [t.server_ttft * 1e3 for t in traces if t.server_ttft is not None]
    m = {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
         "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
         "server_ttft_p50_ms": percentile(server_ttft, 50) if server_ttft else float("nan"),
         "cached": sum(t.cached for t in traces),
         "tokens_per_event": tokens / max(1, sum(len(t.events) for t in traces))}
    if scenario == "single":
        m["decode_tps"] = statistics.median(t.decode_tps for t in traces)
        reported = [t.server_decode_tps for t in traces if t.server_decode_tps is not None]
        m["server_decode_tps"] = statistics.median(reported) if reported else float("nan")
        m["e2e_s"] = statistics.median(t.events[-1][0] - t.sent for t in traces)
    gaps = [g * 1e3 for t in traces for g in t.gaps()]
    m["itl_p50_ms"], m["itl_p99_ms"] = percentile(gaps, 50), percentile(gaps, 99)
    m["itl_mean_ms"] = statistics.fmean(gaps) if gaps else float("nan")
    return m


ROWS = {  # scenario -> (metric key, label, higher is better)
    "single": [("decode_tps", "decode tok/s (client)", True),
               ("server_decode_tps", "decode tok/s (llama.cpp's own timings)", True),
               ("ttft_p50_ms", "TTFT ms, median (client)", False),
               ("server_ttft_p50_ms", "TTFT ms, median (server's own)", False),
               ("itl_p50_ms", "ITL p50 ms", False), ("itl_p99_ms", "ITL p99 ms", False),
               ("e2e_s", "request latency s, median", False)],
    "conc": [("tok_s", "generated tok/s", True), ("itl_p50_ms", "ITL p50 ms", False),
             ("itl_p99_ms", "ITL p99 ms", False), ("itl_mean_ms", "ITL mean ms", False),
             ("ttft_p50_ms", "TTFT p50 ms", False), ("ttft_p99_ms", "TTFT p99 ms", False),
             ("wall_s", "wall s", False)],
    "batch64": [("tok_s", "generated tok/s", True), ("wall_s", "wall s", False),
                ("ttft_p50_ms", "TTFT p50 ms", False), ("ttft_p99_ms", "TTFT p99 ms", False),
                ("itl_p50_ms", "ITL p50 ms", False), ("itl_p99_ms", "ITL p99 ms", False)],
}


def scenario_table(scenario: str, results: dict[str, list[dict]]) -> str:
    rows = []
    kept = {side: undisturbed(rs) for side, rs in results.items()}
    for key, label, higher in ROWS["conc" if scenario in CONCURRENCY else scenario]:
        a = statistics.median(r[key] for r in kept["stemma"])
        b = statistics.median(r[key] for r in kept["llama.cpp"])
        if key == "server_decode_tps":
            a = float("nan")  # stemma reports no decode rate of its own
        ratio = a / b if b and a == a and b == b else float("nan")
        rows.append([f"{label} ({'higher' if higher else 'lower'} is better)",
                     round(a, 2) if a == a else "-", round(b, 2) if b == b else "-",
                     f"{ratio:.2f}x" if ratio == ratio else "-"])
    extra = []
    for side in ("stemma", "llama.cpp"):
        rs = results[side]
        extra.append(f"{side}: tokens/round {rs[0]['tokens']}, tokens/event "
                     f"{statistics.median(r['tokens_per_event'] for r in rs):.2f}, cached prompt tokens "
                     f"{sum(r['cached'] for r in rs)}, per-round {'decode' if scenario == 'single' else 'tok/s'} "
                     + ", ".join(f"{r['decode_tps' if scenario == 'single' else 'tok_s']:.1f}" for r in rs)
                     + f"; other processes used <= {max(r['foreign_cores'] for r in rs):.2f} cores"
                     + (f"; {len(rs) - len(kept[side])} disturbed round(s) left out of the medians"
                        if len(kept[side]) < len(rs) else ""))
    return table(["metric", "stemma", "llama.cpp", "stemma / llama.cpp"], rows) + "\n" + "\n".join(extra)


def parse_options(items: list[str]) -> dict:
    """key=value EngineConfig fields; a text field takes the text as it is (speculative=none),
    others a Python literal (numbers, True/False/None)."""
    from stemma.cli_args import _kind
    from stemma.engine_config import EngineConfig
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--stemma-options takes key=value, got {item!r}")
        if key in EngineConfig.__dataclass_fields__ and _kind(EngineConfig, key) is str:
            out[key] = value
            continue
        low = value.lower()
        if low in ("true", "false", "none", "null"):
            out[key] = {"true": True, "false": False}.get(low)
            continue
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    EngineConfig.from_kwargs(**out)  # fails early on an unknown field or a bad value
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stemma-options", nargs="*", default=[], metavar="KEY=VALUE",
                    help="EngineConfig fields for stemma.Runtime, e.g. quantization=int8")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--batch-parallel", type=int, nargs="+", default=[16, 32, 64],
                    help="llama-server -np values measured for batch64 (its best is compared)")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags, one string, e.g. '--poll 0'")
    ap.add_argument("--llama-version", default=llamacpp.LLAMA_CPP_PYTHON_VERSION,
                    help="llama-cpp-python sdist whose llama.cpp is built")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--single-requests", type=int, default=3, help="sequential requests per round in single")
    ap.add_argument("--batch-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--idle-wait", type=float, default=120.0,
                    help="seconds to wait, before each measurement, for other processes to go quiet")
    ap.add_argument("--disturbed-retries", type=int, default=1,
                    help=f"times a round is measured again when other processes used > {DISTURBED_CORES} cores")
    return ap.parse_args(argv)


def stemma_threads() -> str:
    import torch
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}
    return f"torch intra-op threads {torch.get_num_threads()} (torch's default here{'; ' + str(env) if env else ''})"


def wait_idle(max_wait: float, servers: tuple[int, ...]) -> None:
    """Waits (up to max_wait seconds) until other processes, both servers included (stemma's
    background compile), use at most DISTURBED_CORES for 1 s."""
    deadline = time.monotonic() + max_wait
    waited = False
    while True:
        with CpuAudit(bystanders=servers) as audit:
            time.sleep(1.0)
        if not audit.foreign_cores > DISTURBED_CORES or time.monotonic() > deadline:
            break
        if not waited:
            print(f"    waiting for other processes to quiet down ({audit.foreign_cores:.2f} cores)",
                  file=sys.stderr, flush=True)
            waited = True


def undisturbed(rounds: list[dict]) -> list[dict]:
    """The rounds no other process disturbed; all of them if every one was."""
    quiet = [r for r in rounds if not r["foreign_cores"] > DISTURBED_CORES]
    return quiet or rounds


async def run_all(args, stemma: StemmaSide, llama: LlamaSide, tokenizer) -> dict:
    results = {}
    for si, scenario in enumerate(args.scenarios):
        parallels = args.batch_parallel if scenario == "batch64" else \
            [{"single": 1}.get(scenario) or CONCURRENCY[scenario]]
        concurrent = scenario != "single"
        prompts = Prompts(tokenizer, args.prompt_len, seed=args.seed * 1000 + si)
        commands: dict[int, str] = {}

        async def llama_at(parallel: int) -> None:
            """llama-server at -np `parallel`; a server started for it is warmed up first."""
            if llama.server is None or llama.server.parallel != parallel:
                llama.serve(parallel)
                await llama.run(warmup_jobs(scenario, prompts, args), concurrent)
            commands[parallel] = " ".join(llama.server.command)
        for parallel in parallels:  # warm-up: first-use allocations at this batch size
            await llama_at(parallel)
        await stemma.run(warmup_jobs(scenario, prompts, args), concurrent)
        if scenario == "single":  # a single stream starts the engine's decode compile: let it settle
            await stemma.settle_compile(prompts, args)
        else:  # the batch sizes of this scenario each have their compiled graph: let them settle
            await stemma.settle_batched(jobs_for(scenario, prompts, args, seed=args.seed * 1000 + 100 * si + 99),
                                        concurrent)
        per_side = {"stemma": [], "llama.cpp": []}
        per_parallel: dict[int, list[dict]] = {p: [] for p in parallels}  # llama.cpp's, by -np
        for rnd in range(args.rounds):
            jobs = jobs_for(scenario, prompts, args, seed=args.seed * 1000 + 100 * si + rnd)
            turns = [(stemma, None)] + [(llama, p) for p in parallels]
            for sj, (side, parallel) in enumerate(turns):
                if parallel is not None:
                    await llama_at(parallel)
                for attempt in range(1 + args.disturbed_retries):
                    if attempt:  # the same prompts again would hit the prefix caches: fresh ones
                        jobs = fresh_like(jobs, None if scenario == "batch64" else prompts,
                                          seed=args.seed * 1000 + 100 * si + 50 + 10 * sj + attempt)
                    wait_idle(args.idle_wait, stemma.pids + llama.pids)
                    other = llama if side is stemma else stemma
                    with CpuAudit(bystanders=other.pids) as audit:
                        wall, traces = await side.run(jobs, concurrent)
                    m = measure(scenario, wall, traces)
                    m["foreign_cores"] = audit.foreign_cores
                    key = "decode_tps" if scenario == "single" else "tok_s"
                    np_ = f" -np {parallel}" if len(parallels) > 1 and parallel is not None else ""
                    print(f"  {scenario:8s} round {rnd + 1} {side.name + np_:9s} {m[key]:7.1f} "
                          f"{'decode tok/s' if scenario == 'single' else 'tok/s'}  ttft p50 {m['ttft_p50_ms']:7.1f} ms  "
                          f"itl p50/p99 {m['itl_p50_ms']:.1f}/{m['itl_p99_ms']:.1f} ms  wall {wall:.1f}s  "
                          f"other processes {audit.foreign_cores:.2f} cores", file=sys.stderr, flush=True)
                    if not audit.foreign_cores > DISTURBED_CORES:
                        break
                    print(f"    disturbed (other processes used {audit.foreign_cores:.2f} cores)"
                          + ("; measuring again" if attempt < args.disturbed_retries else "; kept"),
                          file=sys.stderr, flush=True)
                (per_side["stemma"] if side is stemma else per_parallel[parallel]).append(m)
        key = "decode_tps" if scenario == "single" else "tok_s"
        best = max(parallels, key=lambda p: statistics.median(m[key] for m in per_parallel[p]))
        per_side["llama.cpp"] = per_parallel[best]
        sweep = {p: statistics.median(m[key] for m in per_parallel[p]) for p in parallels}
        results[scenario] = (per_side, best, jobs, commands[best], sweep)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    options = parse_options(args.stemma_options)
    t_start = time.perf_counter()
    binary = llamacpp.ensure_built(args.llama_version)
    record = llamacpp.build_record(args.llama_version) or {}
    gguf = Path(options["model"]) if options.get("model") else llamacpp.default_gguf()
    if gguf.suffix != ".gguf":
        raise SystemExit("llama.cpp needs a .gguf model: give --stemma-options model=PATH.gguf")

    stemma = StemmaSide(options)
    llama = LlamaSide(binary, gguf, args.llama_threads, slot_ctx(args), shlex.split(args.llama_args))
    print(f"stemma server ready in {stemma.startup_s:.1f}s", file=sys.stderr)
    try:
        from stemma.text.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(str(gguf))
        # this client's own full collections (50-100 ms each, measured) would land in the gaps of
        # whichever side it measures: its startup heap is frozen, as the servers' are
        gc.collect()
        gc.freeze()
        results = asyncio.run(run_all(args, stemma, llama, tokenizer))
    finally:
        llama.stop()
        stemma.close()

    # ---- report ----
    print(f"\nmodel: {gguf}")
    print(f"stemma: served (stemma.Runtime: engine + gateway processes, async client, one connection per "
          f"concurrent request); options {options or 'defaults'}; {stemma_threads()}")
    print(f"llama.cpp: llama-server from llama-cpp-python {args.llama_version} "
          f"({record.get('llama_server_version', '?').splitlines()[0] if record.get('llama_server_version') else '?'}), "
          f"-t {args.llama_threads} (batch threads = -t), -c parallel x {slot_ctx(args)}, HTTP /completion stream; "
          f"{binary}")
    print(f"all requests greedy, ignore_eos; {args.rounds} rounds, stemma then llama.cpp in each; "
          f"tables show the median over rounds; CPUs: {os.cpu_count()}")
    sample = Prompts(tokenizer, args.prompt_len, seed=args.seed * 1000).ids()
    print(f"prompts (single/conc): {args.prompt_len} tokens of random common words, fresh per request; e.g. "
          f"{tokenizer.decode(sample, skip_special_tokens=True)[:160]!r}...")
    for scenario, (per_side, parallel, jobs, command, sweep) in results.items():
        prompt_lens = [len(j.ids) for j in jobs]
        outs = [j.max_new for j in jobs]
        if scenario == "single":
            what = (f"{args.single_requests} sequential requests per round, {args.prompt_len}-token prompt, "
                    f"{args.new_tokens} new tokens; llama-server -np 1")
        elif scenario in CONCURRENCY:
            what = (f"{parallel} concurrent requests, {args.prompt_len}-token prompts, {args.new_tokens} new "
                    f"tokens each; llama-server -np {parallel}")
        else:
            what = (f"{len(jobs)} requests at once, mixed-longtail: prompts {min(prompt_lens)}-{max(prompt_lens)} "
                    f"tokens (mean {statistics.fmean(prompt_lens):.0f}), outputs {min(outs)}-{max(outs)} "
                    f"(median {statistics.median(outs):.0f}, total {sum(outs)}); llama-server -np {parallel}, "
                    f"its best of -np " + ", ".join(f"{p}: {v:.1f} tok/s" for p, v in sweep.items()))
        print(f"\n== {scenario}: {what}")
        print(f"   $ {command}")
        print(scenario_table(scenario, per_side))
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
