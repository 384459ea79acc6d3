"""Soak: a `stemma serve`-style server under 32 mixed clients for --minutes (10 by default),
recording every request's fate; it ends with a verdict on what must hold after a long run.

    python benchmarks/soak.py                                   # default model, 10 minutes
    python benchmarks/soak.py --minutes 1 --model DIR --dtype float32 --attention-backend torch

The engine runs in float32 unless --dtype says otherwise: greedy outputs are compared with the
reference, and only float32 gives the same tokens alone and batched (in bfloat16 a cached prefix
and a full prefill round differently, so mismatches then count rounding, not bugs).

The server is the one `stemma serve` runs (an engine and a gateway process, HTTP and ZeroMQ on
free loopback ports). Half the clients speak ZeroMQ (stemma.connect("tcp://...")), half HTTP
(stemma.connect("http://...") for stemma's /generate, and raw /v1/completions for the OpenAI
API). Each client loops until the time is up, drawing one job at a time from its front's mix:
greedy requests (streamed and not, some on a long shared prefix) whose outputs must equal the
reference, sampled requests with n = 2, regex-constrained requests (their text must fullmatch),
aborts mid-stream, abrupt disconnects (a connection of its own closed mid-stream), prompts past
the context and malformed requests (which must get an error).

The reference: each greedy prompt once alone over ZeroMQ before the mixed traffic starts. The
warm-up is the traffic's first part: at least --warmup seconds (default: 10% of the run, at least
10 s) and until the radix cache has filled the KV pool (its steady state), but at most 40% of the
run. RSS is sampled all along; a process's RSS after the warm-up and at the end are the medians
of the first and the last fifth of the later samples (a single sample swings by several percent
as the allocator takes and returns memory), and all the samples are printed.

Fates: `answer` (a final output), `error` (the server's error), `abandoned` (a disconnect this
client made on purpose: no answer is due), `lost` (neither answer nor error within
--request-timeout). The verdict: 0 lost, 0 unexpected fates (an error where an answer was due,
or the other way round), 0 greedy mismatches, 0 constraint violations, RSS growth after the
warm-up under 5% for the engine and the gateway, their open descriptors back to at most the
warm-up count (+4) once the clients have closed, and the KV pool whole with nothing running.
Exit status 0 when all of it holds, else 1. --json writes the figures to a file.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402
from serving import START_TIMEOUT_S, WORDS, start_server  # noqa: E402

from stemma.cli_args import add_dataclass_args, collect  # noqa: E402
from stemma.engine_config import EngineConfig  # noqa: E402

CLIENTS = 32
SOAK_DTYPE = "float32"  # where greedy outputs are batch-invariant (bf16 rounds batches differently)
RSS_GROWTH_LIMIT = 0.05
FD_SLACK = 4
REGEX = r"[0-9]{2,4}-[a-z]{2}"
GREEDY_TOKENS = 12


@dataclass
class Fate:
    kind: str
    front: str
    fate: str               # answer, error, abandoned, lost
    expected: str           # answer, error, abandoned
    mismatch: bool = False  # a greedy output that differs from the reference
    violation: bool = False  # a constrained output that does not fullmatch its regex


# ---- the workload ----
@dataclass(frozen=True)
class Prompts:
    greedy: list[str]        # the reference set: 8 short ones, then 8 on a long shared prefix
    past_context: str
    long_tokens: int         # max_new_tokens of the requests aborted or disconnected mid-stream


PREFIX_TOKENS = 1024  # the long shared prefix: at most this, and at most a third of the context


async def count_tokens(url: str, text: str) -> int:
    import httpx2
    async with httpx2.AsyncClient() as http:
        return (await http.post(url + "/tokenize", json={"prompt": text}, timeout=30)).json()["count"]


async def make_prompts(url: str, context: int, seed: int) -> Prompts:
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    budget = min(PREFIX_TOKENS, context // 3)
    prefix = words(budget)
    while await count_tokens(url, prefix) > budget:  # a long shared prefix, well inside the context
        prefix = prefix[:len(prefix) * 3 // 4].rsplit(" ", 1)[0]
    short = [words(rng.randint(4, 16)) for _ in range(8)]
    shared = [prefix + " " + words(rng.randint(2, 8)) for _ in range(8)]
    past = words(context + 16)
    while await count_tokens(url, past) <= context:  # just past the context: cheap to tokenize
        past += " " + words(len(past.split()) // 2)
    return Prompts(short + shared, past, context // 2)


def greedy_params(n_tokens: int = GREEDY_TOKENS) -> dict:
    return {"temperature": 0.0, "max_new_tokens": n_tokens, "ignore_eos": True}


class Reference:
    """Each greedy prompt's output alone: token ids and text."""

    def __init__(self, outputs: dict[str, tuple[list[int], str]]):
        self.outputs = outputs

    @classmethod
    async def build(cls, client, prompts: list[str]) -> "Reference":
        out = {}
        for p in prompts:
            o = await client.agenerate(p, greedy_params())
            out[p] = (list(o.token_ids), o.text)
        return cls(out)

    def differs(self, prompt: str, ids: list[int] | None = None, text: str | None = None) -> bool:
        want_ids, want_text = self.outputs[prompt]
        return (ids is not None and ids != want_ids) or (text is not None and text != want_text)


# ---- jobs: each returns a Fate ----
class Jobs:
    def __init__(self, prompts: Prompts, ref: Reference, url: str, address: str, timeout: float,
                 model: str, pids: dict[str, int]):
        self.prompts, self.ref, self.url, self.address, self.timeout = prompts, ref, url, address, timeout
        self.model, self.pids = model, pids  # the OpenAI model id; the server's processes

    async def greedy(self, client, front: str, rng: random.Random) -> Fate:
        prompt = rng.choice(self.prompts.greedy)
        out = await client.agenerate(prompt, greedy_params(), timeout=self.timeout)
        return Fate("greedy", front, "answer", "answer", self.ref.differs(prompt, list(out.token_ids)))

    async def greedy_stream(self, client, front: str, rng: random.Random) -> Fate:
        prompt = rng.choice(self.prompts.greedy)
        stream = client.astream(prompt, greedy_params(), timeout=self.timeout)
        text = "".join([d async for d in stream])
        mismatch = self.ref.differs(prompt, list(stream.output.token_ids), text)
        return Fate("greedy_stream", front, "answer", "answer", mismatch)

    async def sampled_n2(self, client, front: str, rng: random.Random) -> Fate:
        params = {"temperature": 0.9, "max_new_tokens": 8, "n": 2, "seed": rng.randrange(1 << 30)}
        outs = await client.agenerate(rng.choice(self.prompts.greedy), params, timeout=self.timeout)
        if len(outs) != 2:
            raise RuntimeError(f"n=2 gave {len(outs)} outputs")
        return Fate("sampled_n2", front, "answer", "answer")

    async def constrained(self, client, front: str, rng: random.Random) -> Fate:
        params = {"temperature": 0.8, "max_new_tokens": 16, "regex": REGEX, "seed": rng.randrange(1 << 30)}
        out = await client.agenerate(rng.choice(self.prompts.greedy), params, timeout=self.timeout)
        return Fate("constrained", front, "answer", "answer", violation=not re.fullmatch(REGEX, out.text))

    async def abort(self, client, front: str, rng: random.Random) -> Fate:
        stream = client.astream(rng.choice(self.prompts.greedy[:8]), greedy_params(self.prompts.long_tokens),
                                timeout=self.timeout)
        got = 0
        async for _ in stream:
            got += 1
            if got == 2:
                await client.aabort(stream.rid)
        if front == "http":  # the HTTP client's abort closes its stream: nothing more comes
            return Fate("abort", front, "abandoned", "abandoned")
        reason = stream.output.finish_reason if stream.output else None
        # "length": the abort came as the request finished by itself (a fast model); still an answer
        return Fate("abort", front, "answer" if reason in ("abort", "length") else f"finish {reason}", "answer")

    async def disconnect(self, client, front: str, rng: random.Random) -> Fate:
        """A connection of its own, closed abruptly mid-stream."""
        from stemma.client.sync import connect
        own = connect(self.address if front == "zmq" else self.url)
        try:
            stream = own.astream(rng.choice(self.prompts.greedy[:8]), greedy_params(self.prompts.long_tokens),
                                 timeout=self.timeout)
            await stream.__anext__()
        finally:
            own.close()
        return Fate("disconnect", front, "abandoned", "abandoned")

    async def past_context(self, client, front: str, rng: random.Random) -> Fate:
        await client.agenerate(self.prompts.past_context, greedy_params(), timeout=self.timeout)
        return Fate("past_context", front, "answer", "error")

    async def bad_ids(self, client, front: str, rng: random.Random) -> Fate:
        await client.agenerate([5, 10 ** 9], greedy_params(), timeout=self.timeout)
        return Fate("bad_ids", front, "answer", "error")

    async def openai_greedy(self, http, front: str, rng: random.Random) -> Fate:
        prompt = rng.choice(self.prompts.greedy)
        body = {"model": self.model, "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0,
                "ignore_eos": True}
        r = await http.post(self.url + "/v1/completions", json=body, timeout=self.timeout)
        if r.status_code != 200:
            return Fate("openai_greedy", front, "error", "answer")
        text = r.json()["choices"][0]["text"]
        return Fate("openai_greedy", front, "answer", "answer", self.ref.differs(prompt, text=text))

    async def openai_bad(self, http, front: str, rng: random.Random) -> Fate:
        body = rng.choice([{"model": self.model, "prompt": "hi", "temperature": -1},
                           {"model": self.model, "prompt": [], "max_tokens": 2},
                           {"model": self.model, "prompt": "hi", "max_tokens": "many"}])
        r = await http.post(self.url + "/v1/completions", json=body, timeout=self.timeout)
        got = "error" if 400 <= r.status_code < 500 and "error" in r.json() else f"status {r.status_code}"
        return Fate("openai_bad", front, got, "error")


STEMMA_MIX = {"greedy": 5, "greedy_stream": 5, "sampled_n2": 2, "constrained": 2, "abort": 1,
              "disconnect": 1, "past_context": 1, "bad_ids": 1}
OPENAI_MIX = {"openai_greedy": 3, "openai_bad": 1}


async def one_job(jobs: Jobs, client, http, front: str, rng: random.Random) -> Fate:
    """One job of the front's mix, its fate recorded whatever happens."""
    from stemma.client.core import RequestTimeout, ServerError
    mix = {**STEMMA_MIX, **(OPENAI_MIX if front == "http" else {})}
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    use = http if kind.startswith("openai") else client
    expected = "error" if kind in ("past_context", "bad_ids", "openai_bad") else \
        "abandoned" if kind == "disconnect" else "answer"
    try:
        return await getattr(jobs, kind)(use, front, rng)
    except RequestTimeout:
        return Fate(kind, front, "lost", expected)
    except ServerError:
        return Fate(kind, front, "error", expected)
    except Exception as exc:  # a client-side failure is a fate too, never hidden
        return Fate(kind, front, f"failed: {type(exc).__name__}: {exc}"[:120], expected)


async def client_loop(jobs: Jobs, front: str, seed: int, running: Callable[[], bool], fates: list[Fate]) -> None:
    import httpx2

    from stemma.client.sync import connect
    rng = random.Random(seed)
    client = connect(jobs.address if front == "zmq" else jobs.url)
    async with httpx2.AsyncClient() as http:
        try:
            while running():
                fates.append(await one_job(jobs, client, http, front, rng))
        finally:
            client.close()


# ---- process figures ----
def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc/*/stat)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def process_tree(pids: dict[str, int]) -> dict[str, int]:
    """The server's processes by name, with their descendants: the engine process is `engine`
    wherever it runs (a child of the gateway or of this process), others `<parent>.child<i>`."""
    out, frontier = dict(pids), list(pids.items())
    while frontier:
        name, pid = frontier.pop()
        for i, child in enumerate(sorted(children(pid))):
            try:
                is_engine = "stemma.engine.process" in cmdline(child)
            except (FileNotFoundError, ProcessLookupError):
                continue
            child_name = "engine" if is_engine else f"{name}.child{i}"
            out[child_name] = child
            frontier.append((child_name, child))
    return out


def server_pids(procs) -> dict[str, int]:
    """The processes ServerProcesses started (the gateway, and the engine where it starts it)."""
    pids = {"gateway": procs.gateway.pid}
    if getattr(procs, "engine", None) is not None:
        pids["engine"] = procs.engine.pid
    return pids


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def sample(pids: dict[str, int]) -> dict[str, tuple[int, int]]:
    out = {}
    for name, pid in process_tree(pids).items():
        try:
            out[name] = (rss_kib(pid), open_fds(pid))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


# ---- the run ----
async def wait_idle(client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = (await client.ainfo())["stats"]
        if stats["running"] == 0 and stats["queue"] == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


async def traffic(jobs: Jobs, running: Callable[[], bool], seed: int, clients: int, series: list,
                  phase: Callable[[], str], every: float) -> list[Fate]:
    """The clients' loops while running() holds, RSS sampled every `every` seconds meanwhile."""
    fates: list[Fate] = []
    fronts = ["zmq" if i % 2 == 0 else "http" for i in range(clients)]
    sampler = asyncio.ensure_future(rss_series(jobs.pids, running, every, phase, series))
    await asyncio.gather(*[client_loop(jobs, f, seed * 1000 + i, running, fates) for i, f in enumerate(fronts)])
    await sampler
    return fates


async def rss_series(pids: dict[str, int], running: Callable[[], bool], every: float,
                     phase: Callable[[], str], out: list) -> None:
    """(time.monotonic(), phase(), {process: RSS KiB}) every `every` seconds while running()."""
    while running():
        out.append((time.monotonic(), phase(), {n: rss for n, (rss, _) in sample(pids).items()}))
        await asyncio.sleep(every)


class WarmUp:
    """Runs for at least `least` seconds and until the radix cache has filled the KV pool (the
    cache's steady state: from then on it evicts), but never past `most` seconds."""

    def __init__(self, control, pids: dict[str, int], least: float, most: float):
        self.control, self.pids, self.least, self.most = control, pids, least, most
        self.start, self.filled = time.monotonic(), False
        self.seconds, self.sample = None, None  # once it is over: how long it took, the processes then

    def running(self) -> bool:
        elapsed = time.monotonic() - self.start
        return elapsed < self.most and not (elapsed >= self.least and self.filled)

    def phase(self) -> str:
        return "warm-up" if self.seconds is None else "soak"

    async def watch(self) -> None:
        """Follows the pool until the warm-up is over (the traffic goes on), then samples."""
        while self.running():
            stats = (await self.control.ainfo())["stats"]
            self.filled = self.filled or stats["pool_free"] <= 0.05 * stats["pool_total"]
            await asyncio.sleep(1.0)
        self.seconds, self.sample = time.monotonic() - self.start, sample(self.pids)


def deadline(seconds: float) -> Callable[[], bool]:
    until = time.monotonic() + seconds
    return lambda: time.monotonic() < until


async def soak(address: str, url: str, pids: dict[str, int], args) -> dict:
    from stemma.client.sync import connect
    figures: dict = {"samples": {"start": sample(pids)}}
    with connect(address) as control:
        info = await control.ainfo()
        prompts = await make_prompts(url, info["context_length"], args.seed)
        ref = await Reference.build(control, prompts.greedy)
        jobs = Jobs(prompts, ref, url, address, args.request_timeout, await served_model(url), pids)
        seconds = args.minutes * 60
        least = args.warmup if args.warmup is not None else max(10.0, 0.1 * seconds)
        warm = WarmUp(control, pids, min(least, seconds / 2), max(least, 0.4 * seconds))
        every = max(2.0, seconds / 60)
        series: list = []
        watcher = asyncio.ensure_future(warm.watch())
        fates = await traffic(jobs, deadline(seconds), args.seed, args.clients, series, warm.phase, every)
        await watcher
        figures["warmup"] = {"seconds": round(warm.seconds, 1), "pool_filled": warm.filled}
        figures["samples"]["warm"] = warm.sample
        figures["rss_series"] = [(round(t - series[0][0], 1), phase, rss) for t, phase, rss in series]
        stats = await wait_idle(control)
        await asyncio.sleep(1.0)  # the gateway notices the closed clients
        figures["samples"]["end"] = sample(pids)
        figures["stats"] = {k: stats[k] for k in ("pool_whole", "running", "queue", "retractions",
                                                  "generated_tokens", "cache_hit_rate") if k in stats}
    figures["fates"] = [asdict(f) for f in fates]
    return figures


async def served_model(url: str) -> str:
    import httpx2
    async with httpx2.AsyncClient() as http:
        return (await http.get(url + "/v1/models", timeout=30)).json()["data"][0]["id"]


# ---- the report ----
def verdict(figures: dict) -> dict:
    fates = [Fate(**f) for f in figures["fates"]]
    samples = figures["samples"]
    growth = {name: (end - warm) / warm for name, (warm, end) in rss_windows(figures).items()}
    fds_back = all(samples["end"][n][1] <= fd + FD_SLACK for n, (_, fd) in samples["warm"].items()
                   if n in samples["end"] and "." not in n)
    out = {
        "requests": len(fates),
        "lost": sum(f.fate == "lost" for f in fates),
        "unexpected": sum(f.fate != f.expected and f.fate != "lost" for f in fates),
        "mismatches": sum(f.mismatch for f in fates),
        "violations": sum(f.violation for f in fates),
        "rss_growth": growth,
        "fds_back": fds_back,
        "pool_whole": bool(figures["stats"].get("pool_whole")) and figures["stats"].get("running") == 0,
        "rss_measured": set(growth) == {"engine", "gateway"},  # samples after the warm-up exist
    }
    out["ok"] = (out["lost"] == out["unexpected"] == out["mismatches"] == out["violations"] == 0
                 and all(g < RSS_GROWTH_LIMIT for g in growth.values()) and fds_back and out["pool_whole"]
                 and out["rss_measured"])
    return out


def rss_windows(figures: dict) -> dict[str, tuple[float, float]]:
    """Per server process, the median RSS of the first and of the last fifth of the samples taken
    after the warm-up (the last window with the sample taken once idle): single samples swing
    by several percent as the allocator takes and returns memory."""
    soak = [rss for _, phase, rss in figures["rss_series"] if phase == "soak"]
    k = max(1, len(soak) // 5)
    end_idle = {name: rss for name, (rss, _) in figures["samples"]["end"].items()}
    out = {}
    for name in ("engine", "gateway"):
        first = [p[name] for p in soak[:k] if name in p]
        last = [p[name] for p in soak[-k:] if name in p] + ([end_idle[name]] if name in end_idle else [])
        if first and last:
            out[name] = (median(first), median(last))
    return out


def report(figures: dict, v: dict) -> str:
    fates = [Fate(**f) for f in figures["fates"]]
    by_kind = Counter((f.kind, f.front, f.fate) for f in fates)
    rows = [[kind, front, fate, n] for (kind, front, fate), n in sorted(by_kind.items())]
    lines = ["fates:", table(["kind", "front", "fate", "requests"], rows), ""]
    s = figures["samples"]
    names = sorted(set(s["start"]) | set(s["warm"]) | set(s["end"]))

    def cell(point, name, i):
        return s[point][name][i] if name in s[point] else "-"

    proc_rows = [[n, *(cell(p, n, 0) // 1024 if n in s[p] else "-" for p in ("start", "warm", "end")),
                  f"{100 * v['rss_growth'][n]:+.2f}%" if n in v["rss_growth"] else "-",
                  *(cell(p, n, 1) for p in ("start", "warm", "end"))] for n in names]
    windows = rss_windows(figures)
    lines += [f"warm-up: {figures['warmup']['seconds']} s, the radix cache filled the pool: "
              f"{figures['warmup']['pool_filled']}"]
    lines += [f"{n} RSS median after the warm-up {w / 1024:.1f} MiB, at the end {e / 1024:.1f} MiB"
              for n, (w, e) in windows.items()]
    lines += ["processes (single samples, RSS in MiB; growth: the medians above, end over warm-up):",
              table(["process", "rss_start", "rss_warm", "rss_end", "growth", "fds_start", "fds_warm", "fds_end"],
                    proc_rows), ""]
    for name in ("engine", "gateway"):
        points = [f"{t:.0f}s {rss[name] // 1024}" for t, _, rss in figures.get("rss_series", []) if name in rss]
        lines.append(f"{name} RSS over time (MiB): " + ", ".join(points))
    lines.append("")
    unexpected = Counter(f"{f.kind}/{f.front}: {f.fate} (expected {f.expected})" for f in fates
                         if f.fate != f.expected and f.fate != "lost")
    for what, n in unexpected.most_common(10):
        lines.append(f"unexpected: {what} x{n}")
    lines.append(f"requests {v['requests']}  lost {v['lost']}  unexpected {v['unexpected']}  "
                 f"greedy mismatches {v['mismatches']}  constraint violations {v['violations']}  "
                 f"fds back {v['fds_back']}  pool whole {v['pool_whole']}  stats {figures['stats']}")
    lines.append(f"verdict: {'ok' if v['ok'] else 'FAILED'}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the mixed traffic runs")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds of traffic before the warm-up figures (default: 10%% of the run, >= 10 s)")
    ap.add_argument("--clients", type=int, default=CLIENTS, help="concurrent clients, half per front")
    ap.add_argument("--request-timeout", type=float, default=300.0,
                    help="seconds after which a request with no answer and no error counts as lost")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures and the verdict to this file")
    add_dataclass_args(ap, EngineConfig)
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.clients < 2:
        ap.error("--minutes must be > 0 and --clients >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    config = {"dtype": SOAK_DTYPE, **collect(args, EngineConfig)}
    t0 = time.perf_counter()
    procs, address, url = start_server(config)
    print(f"server ready in {time.perf_counter() - t0:.1f}s (timeout {START_TIMEOUT_S:g}): ZeroMQ {address}, "
          f"HTTP {url}; {args.clients} clients for {args.minutes:g} min", file=sys.stderr)
    try:
        figures = asyncio.run(soak(address, url, server_pids(procs), args))
    finally:
        procs.stop()
    v = verdict(figures)
    print(report(figures, v))
    if args.json:
        Path(args.json).write_text(json.dumps({"verdict": v, **figures}))
    return 0 if v["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
