"""Serving while the decode graphs compile in the background: stemma's compile (its Python held
at the compile gate, its compiler processes at the lowest CPU priority, its results frozen out of
the garbage collector's full collections at the next idle moment) against the same compile
without that freeze (`python-gc`), without the gate too (`ungated`), and without the low
priority either.

Under `compile_decode=auto` an engine compiles one decode graph per bucket of batch sizes on a
background thread once it has run 128 decode forwards (`executor/compiled_decode.py`), while its
steps go on eagerly. Each config runs in a process of its own with an Inductor cache of its own
(a fresh temporary folder: neither reuses the other's compiles); the configs take turns
`--repeats` times. Workloads:
- `single` (default): a REPL user or an agent loop. One request at a time (a fresh random
  64-token prompt, 64 greedy new tokens, EOS ignored), then `--gap` seconds idle, for `--rounds`
  rounds or until every graph met has been compiled and judged.
- `batch`: no idle time. benchmarks/batching.py's mixed-longtail batch (64 requests, greedy, EOS
  ignored; fresh random prompt tokens each round, the same lengths) `--rounds` times back to back.
Each prints every round's tok/s and its compile states. The table gives, per config: tok/s
over all rounds, the rounds run while a compile was queued or running and their median and
slowest tok/s, the median tok/s of the rounds before the compiles started and after they ended,
the seconds from the first compile to the last, and the full garbage collections that ran
inside rounds (their count, time, and the most in one round). The ratio lines compare stemma's slowest
round during the compiles, and its tok/s over all rounds, with each other config's (under
`single` the idle gaps are outside every round, and each config runs until its graphs are judged).

    python benchmarks/compile_load.py [--workload single|batch] [--rounds 60] [--gap 2]
                                      [--repeats 1] [--configs stemma python-gc ungated]

Under `batch`, stemma's compile waits for idle time that never comes, so its engine stays eager
for the whole run; the configs without the gate compile, and the graphs they keep would repay
the slow rounds in a run long enough: the script reports the rounds it ran, nothing beyond.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching import workload  # noqa: E402
from common import CpuAudit, table  # noqa: E402

CONFIGS = ("stemma", "python-gc", "ungated", "default-priority")
STOP_STATES = ("kept", "dropped", "failed")
AFTER = 3  # rounds run once every graph met is judged (single)


def configure(name: str) -> None:
    """`stemma`: the engine process's garbage collection too (stemma.gc_pauses: its heap frozen
    once loaded and after each run of compiles, at an idle moment, here the gap after a round);
    `python-gc`: stemma without that (gc_freeze=false); `ungated`: that, and the compile
    thread's Python runs beside the forwards (no compile gate), and the row ops' trial is held
    by a step, as before the gate (an unpaced thread's trial would retake every timing that a
    step's forward overlapped); `default-priority`: that, and the compile thread at the
    process's own priority. Every config times its full collections (`gc` in each round's line)."""
    import contextlib
    from stemma.executor import compile_gate, compiled_decode, compiled_rows
    if name in ("ungated", "default-priority"):
        compile_gate.CompileGate.paced = lambda self: contextlib.nullcontext()
        trial = compiled_rows.CompiledRows.trial
        compiled_rows.CompiledRows.trial = lambda self, paced=False: None if paced else trial(self)
    if name == "default-priority":
        compiled_decode.COMPILE_NICE = os.getpriority(os.PRIO_PROCESS, 0)


def rounds_of(workload_name: str, requests: int, seed: int):
    """(prompts, params) per round: fresh random prompt tokens each round, the same lengths."""
    from stemma import SamplingParams
    base = ([([0] * 64, 64)] if workload_name == "single" else workload("mixed-longtail", requests, seed=seed))
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for _, n in base]
    r = 0
    while True:
        rng = random.Random(seed * 1000 + r)
        yield [[rng.randrange(10, 30000) for _ in ids] for ids, _ in base], params
        r += 1


def settled(stats: dict) -> bool:
    """Every graph met has been compiled and judged, and no compile is queued."""
    batched = [s for s in (stats["compiled_decode_batched"] or "").split() if s]
    return (stats["compiled_decode_phase"] == "idle" and stats["compiled_decode"] in STOP_STATES
            and all(b.split(":")[1] in STOP_STATES for b in batched))


def child(name: str, args) -> None:
    """One engine, up to `rounds` rounds; one JSON line per round on stdout."""
    configure(name)
    import stemma
    from stemma.gc_pauses import GC_PAUSES
    engine = stemma.Engine(compile_decode="auto")
    GC_PAUSES.watch()
    if name == "stemma":
        GC_PAUSES.enable()
    t0, after = time.monotonic(), None
    for r, (prompts, params) in zip(range(args.rounds), rounds_of(args.workload, args.requests, args.seed)):
        before = engine.stats()["compiled_decode_phase"]
        full = GC_PAUSES.full, GC_PAUSES.full_s
        with CpuAudit() as audit:
            outs = engine.generate(prompts, params)
        stats = engine.stats()
        gc_n, gc_s = GC_PAUSES.full - full[0], GC_PAUSES.full_s - full[1]  # full collections in the round
        print(json.dumps({"round": r, "at": time.monotonic() - t0, "tokens": sum(len(o.token_ids) for o in outs),
                          "seconds": audit.wall, "others": audit.foreign_cores, "before": before,
                          "phase": stats["compiled_decode_phase"], "one": stats["compiled_decode"],
                          "batched": stats["compiled_decode_batched"], "gc": gc_n, "gc_ms": 1e3 * gc_s}),
              flush=True)
        if args.workload == "single":
            if after is None and settled(stats):
                after = r
            if after is not None and r - after >= AFTER:
                return
            idle(args.gap, GC_PAUSES)


def idle(seconds: float, pauses) -> None:
    """The gap after a round, as the engine process's loop spends it: its idle hook every 0.25 s."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        pauses.idle()
        time.sleep(min(0.25, left))


def run_one(name: str, args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="stemma-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "STEMMA_COMPILE": "1"}
        cmd = [sys.executable, __file__, "--child", name, "--workload", args.workload, "--rounds", str(args.rounds),
               "--gap", str(args.gap), "--requests", str(args.requests), "--seed", str(args.seed)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        rounds = []
        for line in proc.stdout:
            row = json.loads(line)
            rounds.append(row)
            print(f"  {name:16s} round {row['round']:2d} at {row['at']:6.1f} s: {row['tokens'] / row['seconds']:7.1f} tok/s "
                  f"in {row['seconds']:6.2f} s  compile {row['before']} -> {row['phase']}; one request {row['one']}; "
                  f"batches {row['batched'] or '-'}  full GCs {row['gc']} ({row['gc_ms']:.0f} ms)  "
                  f"other processes {row['others']:.2f} cores", file=sys.stderr, flush=True)
        if proc.wait() != 0:
            sys.exit(f"the {name} run failed (exit {proc.returncode})")
    return rounds


def summary(rounds: list[dict]) -> dict:
    """Rounds before the compiles, during them (a compile queued or running at either end of the
    round), and after; tok/s of each; seconds from the first compiling round to the last."""
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    during = [r for r in rounds if "compiling" in (r["before"], r["phase"])]
    first = next((i for i, r in enumerate(rounds) if r in during), len(rounds))
    last = max((i for i, r in enumerate(rounds) if r in during), default=first - 1)
    med = lambda rs: statistics.median(map(rate, rs)) if rs else float("nan")  # noqa: E731
    span = (during[-1]["at"] - (during[0]["at"] - during[0]["seconds"])) if during else 0.0
    return {"overall": sum(r["tokens"] for r in rounds) / sum(r["seconds"] for r in rounds),
            "before": med(rounds[:first]), "during": med(during), "slowest": min(map(rate, during), default=float("nan")),
            "after": med(rounds[last + 1:]), "n_during": len(during), "span": span,
            "end": f"{rounds[-1]['phase']}; one {rounds[-1]['one']}; {rounds[-1]['batched'] or '-'}",
            "gc": f"{sum(r['gc'] for r in rounds)} ({sum(r['gc_ms'] for r in rounds):.0f} ms, "
                  f"most in a round {max(r['gc_ms'] for r in rounds):.0f})",
            "others": max(r["others"] for r in rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("single", "batch"), default="single")
    ap.add_argument("--rounds", type=int, default=None, help="at most (single: 80; batch: 10)")
    ap.add_argument("--gap", type=float, default=2.0, help="idle seconds after each round (single)")
    ap.add_argument("--repeats", type=int, default=1, help="turns of the configs")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=["stemma", "ungated"])
    ap.add_argument("--requests", type=int, default=64, help="a batch round's requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 80 if args.workload == "single" else 10
    if args.child:
        child(args.child, args)
        return
    results: dict[str, list[dict]] = {name: [] for name in args.configs}
    for _ in range(args.repeats):
        for name in args.configs:
            results[name].append(summary(run_one(name, args)))
    rows = [[name, i + 1, s["overall"], s["n_during"], round(s["span"], 1), s["before"], s["during"], s["slowest"],
             s["after"], s["end"], s["gc"], s["others"]] for name, runs in results.items() for i, s in enumerate(runs)]
    what = ("one request at a time, 64-token prompts, 64 new tokens, then "
            f"{args.gap:g} s idle" if args.workload == "single"
            else f"{args.requests} requests a round (mixed-longtail), back to back")
    print(f"\n{what}; greedy; compile_decode=auto; default model; {os.cpu_count()} cores")
    print(table(["config", "run", "tok/s over all rounds", "rounds while compiling", "compiling s", "tok/s before", "tok/s while compiling",
                 "slowest round tok/s", "tok/s after", "at the end", "full GCs in rounds", "other processes (cores)"], rows))
    if "stemma" in results:
        for name in results:
            if name != "stemma":
                for i, (ours, theirs) in enumerate(zip(results["stemma"], results[name])):
                    print(f"run {i + 1}: stemma / {name}: slowest round while compiling "
                          f"{ours['slowest'] / theirs['slowest']:.2f}x, tok/s over all rounds "
                          f"{ours['overall'] / theirs['overall']:.2f}x")


if __name__ == "__main__":
    main()
