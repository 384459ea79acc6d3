"""Agent programs arriving over time: program-aware scheduling and KV retention vs request FCFS + LRU.

    python benchmarks/agents.py                       # default model, all four runs, the verdicts
    python benchmarks/agents.py --configs fcfs-lru    # the baseline's two runs only (no verdicts)

One in-process engine per run (default model, its default dtype and speculation, the one-row decode
compile off so that no background compile lands in one run and not another; the batch capped
at --max-running requests, 16 by default: the concurrency at which llama.cpp's server peaks on a
2-core CPU, and the cap that lets a queue form at all, where ordering it can matter), driven through
the frontend: every program is an `@stemma.function` run with `run_async` on one event loop, over
an EngineBackend; each fresh engine is warmed up on a short unrelated program, and its cache
flushed, before the timed part. The workload, deterministic from --seed:
- --programs agent programs (48), arriving at the points of a Poisson process over --arrival-s
  seconds (25, chosen on a 2-core AMD CPU where the baseline served about 50 tokens/s, so that
  the ~4,000 tokens of seed 0's 165 calls would take well over a minute and queues would form;
  on the Intel AMX machine, at about 96 tokens/s, almost no call waits: 0.00-0.02 on average in
  a diagnostic run. The README's Programs section gives what shorter windows did);
- each program makes 1-12 model calls, P(k) proportional to k^-1.3 (heavy-tailed: most make a few,
  some make many);
- 3 system prompts of about 300 tokens of English-like text; each program starts with one of
  them, then a task line of its own (about 30-40 tokens);
- each call is `Thought:` then a greedy gen of exactly --gen-tokens tokens (EOS ignored, so every
  run generates the same tokens); after every call but the last, a `@stemma.tool` call that
  sleeps 50-500 ms (uniform, drawn up front) and returns an observation of about 30-50 tokens,
  appended as `Observation: ...`.
A program's completion time is from its planned arrival to the moment run_async returns.

Runs (--configs all):
- fcfs-lru, full pool: schedule_policy="fcfs", radix_eviction="lru" (request FCFS, LRU eviction),
  kv_pool_tokens=--kv-pool-tokens. During this run the benchmark samples, every 50 ms, the KV
  tokens the live programs (arrived, not finished) need: each one's tokens so far (its last call's
  prompt + completion tokens; before its first call returns, its first prompt), the system prompts
  they share counted once. The peak is the working set;
- program, full pool: schedule_policy="program", radix_eviction="program";
- fcfs-lru and program again with kv_pool_tokens = half the working set (at least the largest
  single call of the first run, prompt + completion).
--configs fcfs-lru runs the baseline's two runs alone (full pool, half pool), --configs program the
program policy's (its own full-pool run then gives the working set).

The table: per config and pool, the median over --rounds runs (3; the configs take turns, each
first in every other round) of: total throughput (generated tokens over first arrival to last
completion; each round's is shown too: the runs differ by up to ~10%, as the tool pauses and
arrivals run on the wall clock and the calls fall into steps differently each time), p50/p95
program completion time, the prefix hit rate (the engine's cached over prompt tokens in the timed
part), the engine's retractions, and the CPU the machine's other processes used meanwhile (average cores; a run they disturbed is no
measurement). Acceptance (default model,
one run):
- full pool: program's throughput within 5% of fcfs-lru's (0.95-1.05x), and with it its p50
  completion time >= 30% lower and its p95 >= 20% lower;
- half pool: program's prefix hit rate >= 15 points above fcfs-lru's.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CpuAudit, percentile, table  # noqa: E402

import stemma  # noqa: E402
from stemma.lang.backends.engine import EngineBackend  # noqa: E402
from stemma.lang.suspend import reserve_threads  # noqa: E402

CONFIGS = {"fcfs-lru": {"schedule_policy": "fcfs", "radix_eviction": "lru"},
           "program": {"schedule_policy": "program", "radix_eviction": "program"}}
SYSTEM_PROMPTS = 3
MAX_CALLS = 12
CALL_EXPONENT = 1.3
PAUSE_S = (0.05, 0.5)
SAMPLE_S = 0.05
STEP_COST_KEYS = ("base_ms", "per_decode_row_ms", "per_prefill_token_ms", "per_1k_keys_ms")

WORDS = """the a an of to and in on for with from by at as is are was were be been it this that
these those each every some any all more most less few many other same new old first last next
early late small large short long high low clear simple careful quick slow open closed full empty
ready able likely useful common public local final main key total single double recent
report table file record list note page line number value price cost order account customer user
team project plan task step result answer question reason rule case example item field name date
time day week month year city road station train ticket hotel room meeting office store product
invoice payment budget stock level sensor reading signal error warning message request response
server database query index search tool search engine calendar weather map route distance hour
check find read write send update compare count sum sort filter match select review confirm
return look open close start finish keep move make take give show tell ask use call need want
should must may can will would could then first also only still again before after while until
because when where which whether if unless so but or not without within between across above
below into over under about around""".split()


@dataclass
class Program:
    pid: int
    arrival: float               # planned start, seconds from the run's start
    system: int                  # which system prompt
    task: str
    pauses: list[float]          # the tool pause after each call but the last
    observations: list[str]      # what each tool call returns
    start_tokens: int = 0        # tokens of its first prompt (set once a tokenizer is loaded)

    @property
    def calls(self) -> int:
        return len(self.pauses) + 1


@dataclass
class Workload:
    systems: list[str]
    programs: list[Program]
    system_tokens: list[int] = field(default_factory=list)
    sizes: dict = field(default_factory=dict)   # token sizes, once a tokenizer is loaded


def prose(rng: random.Random, words: int) -> str:
    """`words` words of English-like sentences."""
    out: list[str] = []
    while len(out) < words:
        sentence = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out.extend(sentence)
    out = out[:words]
    out[-1] = out[-1].rstrip(".") + "."
    return " ".join(out)


def workload(args) -> Workload:
    rng = random.Random(args.seed)
    systems = [f"You are assistant {j + 1} of the operations desk. " + prose(rng, 250) + "\n\n"
               for j in range(SYSTEM_PROMPTS)]
    # a Poisson process with n points in [0, T] puts them at n sorted uniform times
    arrivals = sorted(rng.uniform(0, args.arrival_s) for _ in range(args.programs))
    weights = [k ** -CALL_EXPONENT for k in range(1, MAX_CALLS + 1)]
    programs = []
    for pid, arrival in enumerate(arrivals):
        calls = rng.choices(range(1, MAX_CALLS + 1), weights)[0]
        programs.append(Program(
            pid, arrival, rng.randrange(SYSTEM_PROMPTS),
            f"Task {pid}: " + prose(rng, rng.randint(22, 30)) + "\n",
            [rng.uniform(*PAUSE_S) for _ in range(calls - 1)],
            [prose(rng, rng.randint(27, 43)) for _ in range(calls - 1)]))
    return Workload(systems, programs)


def measure_tokens(work: Workload, codec) -> dict:
    """Sets the programs' first-prompt sizes; returns the workload's token sizes."""
    start = len(codec.start_ids)
    work.system_tokens = [start + len(codec.encode(s)) for s in work.systems]
    for p in work.programs:
        p.start_tokens = start + len(codec.encode(work.systems[p.system] + p.task + "Thought:"))
    obs = [len(codec.encode(o)) for p in work.programs for o in p.observations]
    tasks = [len(codec.encode(p.task)) for p in work.programs]
    return {"system": work.system_tokens, "task": (min(tasks), max(tasks)),
            "obs": (min(obs), max(obs)) if obs else (0, 0)}


def make_agent(live: dict[int, int], largest: list[int]):
    @stemma.tool
    def act(thought: str, observation: str, pause_s: float) -> str:
        time.sleep(pause_s)  # the tool's latency; the thought is its (unused) input
        return observation

    @stemma.function
    def agent(s, program: Program, system: str, gen_tokens: int):
        s += system + program.task
        for i in range(program.calls):
            s += "Thought:" + stemma.gen(f"t{i}", max_tokens=gen_tokens, temperature=0, ignore_eos=True)
            meta = s.get_meta_info(f"t{i}")  # waits for the call
            held = meta["prompt_tokens"] + meta["completion_tokens"]
            live[program.pid] = held
            largest[0] = max(largest[0], held)
            if i < program.calls - 1:
                s += "\nObservation: " + act(s[f"t{i}"], program.observations[i], program.pauses[i]) + "\n"
    return agent


def make_warm_up():
    @stemma.function
    def warm(s, n: int):
        s += f"Count the apples in basket {n}, then write the total.\nAnswer:"
        s += stemma.gen("a", max_tokens=8, temperature=0, ignore_eos=True)
    return warm


def working_set(work: Workload, live: dict[int, int]) -> int:
    """KV tokens the live programs need: each one's own tokens, their system prompts once."""
    systems = {work.programs[pid].system for pid in live}
    own = sum(held - work.system_tokens[work.programs[pid].system] for pid, held in list(live.items()))
    return own + sum(work.system_tokens[j] for j in systems)


async def drive(backend: EngineBackend, work: Workload, gen_tokens: int) -> dict:
    loop = asyncio.get_running_loop()
    reserve_threads(loop, len(work.programs) + 8)  # every body on its own thread at once
    warm = make_warm_up()
    await asyncio.gather(*(warm.run_async(n, backend=backend) for n in range(4)))
    engine = backend.engine
    assert engine.flush_cache()
    live: dict[int, int] = {}
    largest = [0]
    agent = make_agent(live, largest)
    stats0 = engine.stats()
    peak = 0
    t0 = time.perf_counter()

    async def one(p: Program) -> tuple[float, object]:
        await asyncio.sleep(max(0.0, t0 + p.arrival - time.perf_counter()))
        live[p.pid] = p.start_tokens
        state = await agent.run_async(p, work.systems[p.system], gen_tokens, backend=backend)
        done = time.perf_counter() - t0
        del live[p.pid]
        return done, state

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, working_set(work, live))
            await asyncio.sleep(SAMPLE_S)

    sampler = loop.create_task(sample())
    try:
        results = await asyncio.gather(*(one(p) for p in work.programs))
    finally:
        sampler.cancel()
    stats1 = engine.stats()
    engine.check_pool_whole()
    finish = [done for done, _ in results]
    latency = [done - p.arrival for (done, _), p in zip(results, work.programs)]
    generated = stats1["generated_tokens"] - stats0["generated_tokens"]
    booked = sum(state.usage().completion_tokens for _, state in results)
    expected = gen_tokens * sum(p.calls for p in work.programs)
    if generated != expected or booked != expected:
        raise AssertionError(f"the engine generated {generated} tokens and the programs booked {booked}, "
                             f"expected {expected} ({gen_tokens} a call)")
    prompt = stats1["prompt_tokens"] - stats0["prompt_tokens"]
    cached = stats1["cached_tokens"] - stats0["cached_tokens"]
    return {"generated": generated, "wall_s": max(finish) - work.programs[0].arrival,
            "tok_s": generated / (max(finish) - work.programs[0].arrival),
            "p50_s": percentile(latency, 50), "p95_s": percentile(latency, 95),
            "hit_rate": cached / prompt if prompt else 0.0, "prompt": prompt, "cached": cached,
            "retractions": stats1["retractions"] - stats0["retractions"],
            "working_set": peak, "largest_call": largest[0],
            "step_cost": " ".join(f"{stats1['step_cost'].get(k, float('nan')):.4g}" for k in STEP_COST_KEYS)}


def run(name: str, pool: int, work: Workload, args) -> dict:
    # compile_decode off: its background compile would take a core during some runs and not others
    options = {"kv_pool_tokens": pool, "random_seed": args.seed, "max_running_requests": args.max_running,
               "compile_decode": "off", **CONFIGS[name]}
    if args.model:
        options["model"] = args.model
    backend = EngineBackend(**options)
    if not work.sizes:
        work.sizes = measure_tokens(work, backend.codec)
    print(f"{name}, pool {pool}: running ...", file=sys.stderr, flush=True)
    with CpuAudit() as audit:
        out = asyncio.run(drive(backend, work, args.gen_tokens))
    out["foreign_cores"] = audit.foreign_cores
    print(f"{name}, pool {pool}: {out['wall_s']:.1f} s, {out['tok_s']:.1f} tok/s, p50 {out['p50_s']:.2f} s, "
          f"p95 {out['p95_s']:.2f} s, hit rate {100 * out['hit_rate']:.1f}%, peak live KV {out['working_set']}, "
          f"other processes' load {out['foreign_cores']:.2f} cores; the engine's step-cost fit (ms: base, per "
          f"decode row, per prefill token, per 1k keys; agents_bound.py --step-cost takes them) {out['step_cost']}",
          file=sys.stderr, flush=True)
    del backend
    gc.collect()
    return out


def median_run(rs: list[dict]) -> dict:
    """Each figure's median over the rounds (the runs differ: tool pauses and arrivals are wall
    clock, so how the calls fall into steps changes from run to run)."""
    out = dict(rs[0])
    for key, value in rs[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in rs)
    out["tok_s_all"] = [r["tok_s"] for r in rs]
    return out


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def change(cut: float) -> str:
    """A relative cut (1 - new / old) in words."""
    return f"{100 * abs(cut):.1f}% {'lower' if cut >= 0 else 'higher'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", choices=("all", *CONFIGS), default="all",
                    help="all: both configs; one name: that config's full- and half-pool runs")
    ap.add_argument("--programs", type=int, default=48)
    ap.add_argument("--arrival-s", type=float, default=25.0, help="the programs arrive over this long")
    ap.add_argument("--gen-tokens", type=int, default=24, help="tokens each call generates")
    ap.add_argument("--kv-pool-tokens", type=int, default=65536, help="the full pool")
    ap.add_argument("--max-running", type=int, default=16, help="the engine's max_running_requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each config and pool; medians reported")
    ap.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: the default model)")
    args = ap.parse_args()

    names = list(CONFIGS) if args.configs == "all" else [args.configs]
    work = workload(args)
    runs: dict[tuple[str, str], list[dict]] = {}
    def turn(rnd: int) -> list[str]:
        """The configs take turns, each first in every other round (A B, B A, ...; the half pool's
        rounds go on from the full pool's), so that drift slows each alike."""
        return names if rnd % 2 == 0 else names[::-1]

    for rnd in range(args.rounds):
        for name in turn(rnd):
            runs.setdefault((name, "full"), []).append(run(name, args.kv_pool_tokens, work, args))
    first = runs[names[0], "full"][0]
    half = max(first["working_set"] // 2, first["largest_call"])
    for rnd in range(args.rounds, 2 * args.rounds):
        for name in turn(rnd):
            runs.setdefault((name, "half"), []).append(run(name, half, work, args))
    results = {key: median_run(rs) for key, rs in runs.items()}

    calls = [p.calls for p in work.programs]
    pauses = [x for p in work.programs for x in p.pauses]
    sizes = work.sizes
    print(f"{args.model or 'default model'}; {args.programs} agent programs arriving over "
          f"{args.arrival_s:g} s (Poisson, seed {args.seed}); calls per program: mean "
          f"{statistics.mean(calls):.2f}, median {statistics.median(calls):g}, max {max(calls)} "
          f"({sum(calls)} calls); each call a greedy gen of {args.gen_tokens} tokens (EOS ignored); "
          f"tool pauses {len(pauses)}, mean {1e3 * statistics.mean(pauses) if pauses else 0:.0f} ms; "
          f"system prompts {'/'.join(map(str, sizes['system']))} tokens; task lines "
          f"{sizes['task'][0]}-{sizes['task'][1]} tokens; observations {sizes['obs'][0]}-{sizes['obs'][1]} tokens")
    print(f"each figure: the median of {args.rounds} rounds (configs in turns, each first in every other round)")
    print(f"working set (peak KV tokens of the live programs, {names[0]} full pool, first round): "
          f"{first['working_set']}; largest call: {first['largest_call']} tokens; half pool: {half} tokens")
    rows = []
    for (name, size), r in results.items():
        pool = args.kv_pool_tokens if size == "full" else half
        rows.append([name, pool, r["tok_s"], "/".join(f"{x:.0f}" for x in r["tok_s_all"]), r["p50_s"],
                     r["p95_s"], f"{100 * r['hit_rate']:.1f}", r["retractions"], r["foreign_cores"]])
    print(table(["config", "pool tokens", "throughput tok/s", "each round", "p50 s", "p95 s", "hit rate %",
                 "retractions", "others' cores"], rows))
    if len(names) < 2:
        return
    base, prog = results["fcfs-lru", "full"], results["program", "full"]
    ratio = prog["tok_s"] / base["tok_s"]
    p50_cut = 1 - prog["p50_s"] / base["p50_s"]
    p95_cut = 1 - prog["p95_s"] / base["p95_s"]
    points = 100 * (results["program", "half"]["hit_rate"] - results["fcfs-lru", "half"]["hit_rate"])
    print(f"throughput program / fcfs-lru (full pool): {ratio:.3f}x, target 0.95-1.05x: "
          f"{verdict(0.95 <= ratio <= 1.05)}")
    print(f"p50 completion time (full pool): {base['p50_s']:.2f} -> {prog['p50_s']:.2f} s, "
          f"{change(p50_cut)}, target >= 30%: {verdict(p50_cut >= 0.30)}")
    print(f"p95 completion time (full pool): {base['p95_s']:.2f} -> {prog['p95_s']:.2f} s, "
          f"{change(p95_cut)}, target >= 20%: {verdict(p95_cut >= 0.20)}")
    lru, kept = (100 * results[name, "half"]["hit_rate"] for name in CONFIGS)
    print(f"prefix hit rate (half pool, {half} tokens): {lru:.1f}% -> {kept:.1f}%, "
          f"{points:+.1f} points, target >= +15: {verdict(points >= 15)}")


if __name__ == "__main__":
    main()
