"""What any queue order could do for agents.py's full-pool lines, from a model of its workload.

    python benchmarks/agents_bound.py                    # measures the step cost on the default model
    python benchmarks/agents_bound.py --step-cost 70 3 0.5 0     # base, per row, per prefill token, per 1k keys (ms)

agents.py prints the engine's own fit at the end of each of its runs, in the order --step-cost takes.

agents.py asks the program policy for a p50 completion time >= 30% lower and a p95 >= 20% lower
than request FCFS, at equal throughput, with the pool large enough to keep every prefix. With
every prefix kept, the policies differ only in the order the waiting calls are admitted. This
script replays agents.py's workload (the same generator and seed: arrivals, calls per program,
tool pauses, token sizes from the model's tokenizer) through a model of the engine's batch:
- each step admits waiting calls, in the policy's order, while fewer than --max-running run;
- an admitted call prefills the tokens not cached (its task line the first time, else its
  observation; a system prompt once) and then decodes --gen-tokens tokens, one a step;
- a step takes the engine's own step-cost fit (`stats()["step_cost"]`: base + per decode row +
  per prefill token + per thousand keys read), measured here on the model (or --step-cost);
- a call's tool pause starts when the call ends; a program completes with its last call.
No model runs in the replay, and nothing else slows a step: each of those only adds to what the
engine shows.

The orders: fcfs (calls by arrival: agents.py's baseline); program (stemma's `program` policy
with every prefix cached: starved calls, then calls that resume a program, then least attained
service); plas (least attained service alone, Autellix's PLAS); srpt (an oracle: the program
with the fewest calls left first, which no runtime knows; the best order for mean completion).
Each is run at agents.py's arrival window and at shorter ones (more load), at 16 and 8 rows,
over --seeds workloads (seed 0 is agents.py's); the table gives the medians of p50 and p95
completion, their cuts against fcfs, the throughput ratio and the mean number of waiting calls.

All calls are the same size, so the time calls spend waiting, summed, barely depends on the
order (a work-conserving batch): an order can move waiting from short programs to long ones or
back, but not remove it. The p50 program is short (1-2 calls), the p95 one long (10-12 calls),
and both lines ask each to wait less.
"""
from __future__ import annotations

import argparse
import heapq
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agents import STEP_COST_KEYS, Workload, measure_tokens, workload  # noqa: E402
from common import percentile, table  # noqa: E402

from stemma.engine.step_cost import StepShape  # noqa: E402
from stemma.engine_config import EngineConfig  # noqa: E402

STARVE_S = EngineConfig().program_starvation_s   # the engine's default
OBS_FRAME = 5     # tokens of "\nObservation: " ... "\nThought:" around an observation


@dataclass
class Prog:
    pid: int
    arrival: float
    calls: int
    pauses: list[float]
    new_tokens: list[int]    # what each call prefills when its program's earlier tokens are cached
    system: int
    system_tokens: int
    done_calls: int = 0
    attained: int = 0        # tokens computed for it (prefill + decode), as the engine counts them
    context: int = 0


def programs(work: Workload, obs_tokens: list[list[int]]) -> list[Prog]:
    out = []
    for p, obs in zip(work.programs, obs_tokens):
        system = work.system_tokens[p.system]
        first = p.start_tokens - system
        out.append(Prog(p.pid, p.arrival, p.calls, list(p.pauses), [first] + [n + OBS_FRAME for n in obs],
                        p.system, system))
    return out


def order_key(policy: str, now: float):
    def key(item: tuple[Prog, float]) -> tuple:
        prog, since = item
        if policy == "fcfs":
            return (since,)
        if now - since > STARVE_S:
            return (0, 0, since)
        if policy == "program":
            return (1 if prog.done_calls else 2, prog.attained, prog.arrival, since)
        if policy == "plas":
            return (1, prog.attained, prog.arrival, since)
        if policy == "srpt":
            return (1, prog.calls - prog.done_calls, prog.arrival, since)
        raise ValueError(policy)
    return key


def replay(progs: list[Prog], policy: str, coef: np.ndarray, rows: int, gen: int) -> dict:
    """One run of the batch model (a step takes `coef` @ its StepShape's features, in seconds, as
    the engine's StepCost predicts it): p50/p95 completion, throughput, mean waiting calls, and
    each program's completion time."""
    arrivals = [(p.arrival, p.pid) for p in progs]
    heapq.heapify(arrivals)
    by = {p.pid: p for p in progs}
    waiting: list[tuple[Prog, float]] = []
    running: dict[int, int] = {}         # pid -> tokens left to generate
    seen_systems: set[int] = set()
    done: dict[int, float] = {}
    now = tokens = 0.0
    wait_area = 0.0
    while arrivals or waiting or running:
        if not running and not waiting:
            now = max(now, arrivals[0][0])
        while arrivals and arrivals[0][0] <= now:
            ready, pid = heapq.heappop(arrivals)
            waiting.append((by[pid], ready))   # a call waits from when it is ready
        waiting.sort(key=order_key(policy, now))
        shape = StepShape()
        for pid in running:
            shape.decode(by[pid].context + 1)   # its token this step reads itself too, as StepShape.of books it
        while waiting and len(running) < rows:
            prog, _ = waiting.pop(0)
            n = prog.new_tokens[prog.done_calls]
            if prog.done_calls == 0 and prog.system not in seen_systems:
                seen_systems.add(prog.system)
                n += prog.system_tokens
            prefix = prog.context if prog.done_calls else prog.system_tokens
            shape.prefill(n, prefix)
            prog.attained += n
            prog.context = prefix + n
            running[prog.pid] = gen
        if not running:
            continue
        dt = float(shape.features() @ coef)
        wait_area += len(waiting) * dt
        now += dt
        for pid in list(running):
            prog = by[pid]
            running[pid] -= 1
            prog.attained += 1
            prog.context += 1
            tokens += 1
            if running[pid]:
                continue
            del running[pid]
            prog.done_calls += 1
            if prog.done_calls == prog.calls:
                done[pid] = now - prog.arrival
            else:
                heapq.heappush(arrivals, (now + prog.pauses[prog.done_calls - 1], pid))
    latency = list(done.values())
    span = max(by[pid].arrival + t for pid, t in done.items()) - min(p.arrival for p in progs)
    return {"p50": percentile(latency, 50), "p95": percentile(latency, 95), "tok_s": tokens / span,
            "waiting": wait_area / now, "completion": done}


def measure_cost(model: str | None, max_running: int, gen: int) -> tuple[np.ndarray, object]:
    """The engine's own step-cost fit (seconds, StepShape's feature order) after decoding batches
    of 1 to max_running rows (agents.py's engine settings); returns it and the engine's tokenizer."""
    import stemma
    from stemma import SamplingParams
    options = {"compile_decode": "off", "max_running_requests": max_running}
    engine = stemma.Engine(model, **options) if model else stemma.Engine(**options)
    params = SamplingParams(temperature=0, max_new_tokens=gen, ignore_eos=True)
    for rnd in range(2):
        for rows in (1, 2, 4, 8, max_running):
            prompts = [f"Item {rnd}-{rows}-{i}: the report lists the open tasks of the week and" for i in range(rows)]
            engine.generate(prompts, params)
    fit = engine.stats()["step_cost"]
    return np.array([fit[k] for k in STEP_COST_KEYS]) / 1e3, engine.tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=48)
    ap.add_argument("--arrival-s", type=float, nargs="+", default=[25.0, 15.0, 10.0, 6.0, 3.0],
                    help="arrival windows replayed (agents.py's default is 25)")
    ap.add_argument("--max-running", type=int, nargs="+", default=[16, 8])
    ap.add_argument("--gen-tokens", type=int, default=24)
    ap.add_argument("--seeds", type=int, default=20, help="workloads per setting (seeds 0..N-1)")
    ap.add_argument("--step-cost", type=float, nargs=4, default=None, metavar=("BASE", "ROW", "PREFILL", "KEYS"),
                    help="ms: a step's base, per decode row, per prefill token, per 1k keys (default: measured)")
    ap.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: the default model)")
    args = ap.parse_args()

    from stemma.lang.codec import HFCodec
    if args.step_cost:
        from stemma.loader.gguf.loader import default_model_path
        from stemma.text.tokenizer import load_tokenizer
        cost = np.array(args.step_cost) / 1e3
        tokenizer = load_tokenizer(args.model or default_model_path())
        if tokenizer is None:
            raise SystemExit(f"{args.model} has no tokenizer files")
    else:
        cost, tokenizer = measure_cost(args.model, max(args.max_running), args.gen_tokens)
    codec = HFCodec(tokenizer)
    print("step cost (ms): " + ", ".join(f"{key} {1e3 * x:.4g}" for key, x in zip(STEP_COST_KEYS, cost)),
          flush=True)

    built: dict[tuple[int, float], tuple[Workload, list[list[int]]]] = {}

    def fresh(seed: int, window: float) -> list[Prog]:
        """The workload of `seed` arriving over `window` (tokenized once for each), as new records."""
        if (seed, window) not in built:
            work = workload(argparse.Namespace(seed=seed, arrival_s=window, programs=args.programs))
            measure_tokens(work, codec)
            built[seed, window] = work, [[len(codec.encode(o)) for o in p.observations] for p in work.programs]
        return programs(*built[seed, window])

    policies = ["fcfs", "program", "plas", "srpt"]
    rows_out, best = [], None
    for cap in args.max_running:
        for window in args.arrival_s:
            runs = {pol: [replay(fresh(seed, window), pol, cost, cap, args.gen_tokens) for seed in range(args.seeds)]
                    for pol in policies}
            med = {pol: {k: statistics.median(r[k] for r in rs) for k in ("p50", "p95", "tok_s", "waiting")}
                   for pol, rs in runs.items()}
            base = med["fcfs"]
            for pol in policies:
                m = med[pol]
                cut50, cut95 = 1 - m["p50"] / base["p50"], 1 - m["p95"] / base["p95"]
                ratio = m["tok_s"] / base["tok_s"]
                rows_out.append([cap, f"{window:g}", pol, f"{m['p50']:.2f}", f"{m['p95']:.2f}",
                                 f"{100 * cut50:+.1f}%", f"{100 * cut95:+.1f}%", f"{ratio:.3f}", f"{m['waiting']:.2f}"])
                if pol != "fcfs" and 0.95 <= ratio <= 1.05 and cut50 >= 0.30 and (best is None or cut95 > best[0]):
                    best = (cut95, cap, window, pol)
    print(table(["rows", "arrival s", "order", "p50 s", "p95 s", "p50 cut", "p95 cut", "tok/s vs fcfs",
                 "waiting calls"], rows_out))
    print(f"medians over {args.seeds} workloads (seed 0 is agents.py's); a cut is 1 - order / fcfs")
    if best is None:
        print("no order cuts p50 by >= 30% at equal throughput in any setting replayed")
    else:
        cut95, cap, window, pol = best
        print(f"with p50 cut >= 30% at equal throughput, the largest p95 cut: {100 * cut95:.1f}% "
              f"({pol}, {cap} rows, arrivals over {window:g} s); agents.py asks >= 20%: "
              f"{'reachable in this model' if cut95 >= 0.20 else 'not reached in this model'}")


if __name__ == "__main__":
    main()
