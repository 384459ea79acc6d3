"""Serving while the decode graphs compile in the background: the compile thread at the lowest
CPU priority (stemma's default) against the same thread at the default priority.

Under `compile_decode=auto` an engine compiles one decode graph per bucket of batch sizes on a
background thread once it has run 128 decode forwards (`executor/compiled_decode.py`), while its
steps go on eagerly. This script gives the engine no idle time: the default model decodes
benchmarks/batching.py's mixed-longtail batch (64 requests, greedy, EOS ignored; fresh random
prompt tokens each round, the same lengths) `--rounds` times back to back, in one process per
priority, each with an Inductor cache of its own (a fresh temporary folder: neither reuses the
other's compiles). The two take turns `--repeats` times. Each prints every round's tok/s and its
compile states; the table gives, per priority, generated tok/s over all rounds, the slowest
round, and the compile phase at the end, and the ratio of the lowest to the default priority.

    python benchmarks/compile_load.py [--rounds 10] [--repeats 1]

Under load that never lets up, the lowest priority keeps the engine eager (its compiles wait
for idle time), so a run long enough for the default's compiled graphs to repay the rounds they
slowed would favour the default: the script reports the rounds both ran, nothing beyond.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching import workload  # noqa: E402
from common import CpuAudit, table  # noqa: E402

PRIORITIES = {"lowest": None, "default": 0}  # None: stemma's own COMPILE_NICE


def child(nice: int | None, rounds: int, requests: int, seed: int) -> None:
    """One engine, `rounds` rounds back to back; one JSON line per round on stdout."""
    import stemma
    from stemma import SamplingParams
    from stemma.executor import compiled_decode
    if nice is not None:
        compiled_decode.COMPILE_NICE = nice
    engine = stemma.Engine(compile_decode="auto")
    base = workload("mixed-longtail", requests, seed=seed)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for _, n in base]
    for r in range(rounds):
        rng = random.Random(seed * 1000 + r)
        prompts = [[rng.randrange(10, 30000) for _ in ids] for ids, _ in base]
        with CpuAudit() as audit:
            outs = engine.generate(prompts, params)
        stats = engine.stats()
        print(json.dumps({"round": r, "tokens": sum(len(o.token_ids) for o in outs), "seconds": audit.wall,
                          "others": audit.foreign_cores, "phase": stats["compiled_decode_phase"],
                          "one": stats["compiled_decode"], "batched": stats["compiled_decode_batched"]}),
              flush=True)


def run_one(name: str, args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="stemma-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "STEMMA_COMPILE": "1"}
        cmd = [sys.executable, __file__, "--child", name, "--rounds", str(args.rounds),
               "--requests", str(args.requests), "--seed", str(args.seed)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        rounds = []
        for line in proc.stdout:
            row = json.loads(line)
            rounds.append(row)
            print(f"  {name:8s} round {row['round']:2d}: {row['tokens'] / row['seconds']:7.1f} tok/s in "
                  f"{row['seconds']:6.2f} s  compile {row['phase']}; one request {row['one']}; batches "
                  f"{row['batched'] or '-'}  other processes {row['others']:.2f} cores", file=sys.stderr, flush=True)
        if proc.wait() != 0:
            sys.exit(f"the {name} run failed (exit {proc.returncode})")
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1, help="turns of the two priorities")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", choices=list(PRIORITIES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(PRIORITIES[args.child], args.rounds, args.requests, args.seed)
        return
    results: dict[str, list[list[dict]]] = {name: [] for name in PRIORITIES}
    for _ in range(args.repeats):
        for name in PRIORITIES:
            results[name].append(run_one(name, args))
    rows, rates = [], {}
    for name, runs in results.items():
        for i, rounds in enumerate(runs):
            tokens, seconds = sum(r["tokens"] for r in rounds), sum(r["seconds"] for r in rounds)
            rates.setdefault(name, []).append(tokens / seconds)
            rows.append([name, i + 1, tokens, round(seconds, 1), tokens / seconds,
                         max(r["seconds"] for r in rounds), rounds[-1]["phase"],
                         max(r["others"] for r in rounds)])
    print(f"\n{args.requests} requests a round (mixed-longtail, greedy), {args.rounds} rounds back to back, "
          f"compile_decode=auto, default model, {os.cpu_count()} cores")
    print(table(["compile thread", "run", "tokens", "seconds", "tok/s", "slowest round s", "compile at the end",
                 "other processes (cores)"], rows))
    for i, (low, high) in enumerate(zip(rates["lowest"], rates["default"])):
        print(f"run {i + 1}: tok/s at the lowest priority / at the default priority = {low / high:.2f}x")


if __name__ == "__main__":
    main()
