"""Batching modes (continuous, dynamic, static) x radix cache (on, off) on the default model.

Workloads (all requests arrive at once; greedy; EOS ignored so each request generates exactly
its drawn output length):
  mixed-uniform    random prompts of --prompt-min to --prompt-max tokens (default 16-64),
                   outputs uniform in [8, 128]
  mixed-longtail   same prompts, outputs long-tailed in [8, 128] (lognormal, median ~22, as
                   ShareGPT-like traffic: most answers short, a few long)
  shared-prefix    a 400-token shared prefix + a 16-48-token question, outputs uniform in [8, 64]

Every mode runs at the same maximum batch size. The modes take turns, `--rounds` times per
workload, so that a machine whose speed drifts (a shared VM) slows every mode alike. Prints
throughput (generated tokens/s) and TTFT p50/p99 per mode (the round with the median
throughput), the continuous/static ratio of every round, and writes a PNG plot.

    python benchmarks/batching.py [--requests 64] [--max-batch 16] [--rounds 2] [--png benchmarks/batching.png]

With --program-check it runs instead, per workload and in turns, continuous batching with the
radix cache under schedule_policy="fcfs", radix_eviction="lru" and under "program", "program"
(issue 19). The requests carry no program context, so the program policy must order them as
fcfs does and the program eviction rank must evict as LRU does: it prints both throughputs, their
ratio per round, and whether every output was the same. Both engines have the one-row decode
compile off (in auto, each would compile in the background when its own count of one-row steps
came, in one engine's turn and not the other's, and compiled and eager forwards round apart) and
speculation off (its draft lengths follow measured step times, so the verify batches, and with
them bf16's rounding, differ from run to run); the two go first in turn.

    python benchmarks/batching.py --program-check [--rounds 3]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import percentile, table  # noqa: E402

MODES = ("continuous", "dynamic", "static")


def workload(name: str, n: int, seed: int = 0, prompt: tuple[int, int] = (16, 64)) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(10, 30000) for _ in range(k)]  # noqa: E731
    if name == "shared-prefix":
        prefix = tok(400)
        return [(prefix + tok(rng.randint(16, 48)), rng.randint(8, 64)) for _ in range(n)]
    if name == "mixed-uniform":
        return [(tok(rng.randint(*prompt)), rng.randint(8, 128)) for _ in range(n)]
    if name == "mixed-longtail":
        return [(tok(rng.randint(*prompt)), min(128, max(8, round(rng.lognormvariate(3.1, 0.8)))))
                for _ in range(n)]
    raise ValueError(name)


def run(engine, reqs_spec) -> dict:
    from stemma import SamplingParams
    engine.flush_cache()
    t0 = time.perf_counter()
    reqs = [r for ids, n in reqs_spec
            for r in engine.submit(ids, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))]
    engine.run_until_done(reqs)
    wall = time.perf_counter() - t0
    ttft = [r.first_token_time - r.arrival for r in reqs]
    tokens = sum(len(r.output_ids) for r in reqs)
    engine.check_pool_whole()
    return {"throughput": tokens / wall, "wall": wall, "tokens": tokens,
            "outputs": [list(r.output_ids) for r in reqs],
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "cached": sum(r.cached_tokens for r in reqs), "prompt": sum(len(r.input_ids) for r in reqs)}


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = sorted({w for w, _, _ in results})
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, w in zip(axes[0], names):
        labels, values = [], []
        for (wl, mode, radix), r in results.items():
            if wl == w:
                labels.append(f"{mode}\nradix {'on' if radix else 'off'}")
                values.append(r["throughput"])
        ax.bar(range(len(values)), values, color=["C0", "C1", "C2", "C3", "C4", "C5"][:len(values)])
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set_title(w)
        ax.set_ylabel("generated tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PROGRAM_CHECK = {"fcfs-lru": dict(schedule_policy="fcfs", radix_eviction="lru"),
                 "program": dict(schedule_policy="program", radix_eviction="program")}


def program_check(args) -> None:
    import stemma
    warm = [(ids, 4) for ids, _ in workload("mixed-uniform", 4, seed=99)]
    engines = {}
    for name, options in PROGRAM_CHECK.items():  # both in memory: they take turns every round
        engines[name] = e = stemma.Engine(max_running_requests=args.max_batch, kv_pool_tokens=32768,
                                          chunked_prefill_size=1024, compile_decode="off",
                                          speculative="none", **options)
        run(e, warm)
    rows, same = [], True
    for w in args.workloads:
        spec = workload(w, args.requests, prompt=(args.prompt_min, args.prompt_max))
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for rnd in range(args.rounds):
            for name in list(engines)[::1 if rnd % 2 == 0 else -1]:  # each goes first in turn
                runs[name].append(run(engines[name], spec))
            same &= runs["fcfs-lru"][-1]["outputs"] == runs["program"][-1]["outputs"]
        ratios = [p["throughput"] / f["throughput"] for f, p in zip(runs["fcfs-lru"], runs["program"])]
        rows.append([w, statistics.median(r["throughput"] for r in runs["fcfs-lru"]),
                     statistics.median(r["throughput"] for r in runs["program"]),
                     ", ".join(f"{x:.3f}" for x in ratios), f"{statistics.median(ratios):.3f}"])
    print(f"\ndefault model, {args.requests} requests per workload, max batch {args.max_batch}, "
          f"{args.rounds} rounds, requests without program context")
    print(table(["workload", "fcfs-lru tok/s", "program tok/s", "program / fcfs-lru per round", "median"], rows))
    print(f"outputs identical in every round: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=64)
    ap.add_argument("--workloads", nargs="+", default=["mixed-uniform", "mixed-longtail", "shared-prefix"])
    ap.add_argument("--png", default=str(Path(__file__).with_name("batching.png")))
    ap.add_argument("--program-check", action="store_true",
                    help="fcfs + LRU vs the program policy and eviction on requests without program context")
    args = ap.parse_args()
    if args.program_check:
        program_check(args)
        return

    import stemma
    warm = [(ids, 4) for ids, _ in workload("mixed-uniform", 4, seed=99)]
    engines = {}

    def engine_for(mode: str, radix: bool):
        if (mode, radix) not in engines:
            engines.clear()  # one engine (model + KV pool) in memory at a time
            # the decode compile off: under `auto` one mode's background compile (15-30 s a
            # batch size) ran on into the next mode's load and measured runs
            engines[(mode, radix)] = e = stemma.Engine(
                max_running_requests=args.max_batch, enable_radix_cache=radix, batching=mode,
                kv_pool_tokens=32768, dynamic_wait_ms=50, chunked_prefill_size=1024, compile_decode="off")
            run(e, warm)
        return engines[(mode, radix)]

    results, rows, ratios = {}, [], {}
    for w in args.workloads:
        spec = workload(w, args.requests, prompt=(args.prompt_min, args.prompt_max))
        radix_options = (True, False) if w == "shared-prefix" else (True,)
        runs: dict[tuple, list[dict]] = {}
        for rnd in range(args.rounds):
            for radix in radix_options:
                for mode in MODES:
                    r = run(engine_for(mode, radix), spec)
                    runs.setdefault((mode, radix), []).append(r)
                    print(f"  round {rnd + 1} {w:15s} {mode:10s} radix {'on ' if radix else 'off'} "
                          f"{r['throughput']:7.1f} tok/s", flush=True)
            c, st = runs[("continuous", True)][-1], runs[("static", True)][-1]
            ratios.setdefault(w, []).append(c["throughput"] / st["throughput"])
        for (mode, radix), rs in runs.items():
            r = sorted(rs, key=lambda x: x["throughput"])[(len(rs) - 1) // 2]  # the median run (lower)
            results[(w, mode, radix)] = r
            rows.append([w, mode, "on" if radix else "off", r["tokens"], r["wall"], r["throughput"],
                         r["ttft_p50"], r["ttft_p99"], f"{r['cached'] / r['prompt']:.0%}"])
    print(f"\ndefault model, {args.requests} requests per workload, max batch {args.max_batch}, "
          f"mixed prompts {args.prompt_min}-{args.prompt_max} tokens, median of {args.rounds} rounds")
    print(table(["workload", "batching", "radix", "tokens", "wall s", "tok/s", "ttft p50 s", "ttft p99 s",
                 "cached"], rows))
    print()
    for w in args.workloads:
        per_round = ", ".join(f"{x:.2f}x" for x in ratios[w])
        print(f"{w}: continuous / static throughput per round = {per_round} (lowest {min(ratios[w]):.2f}x)")
    if "shared-prefix" in args.workloads:
        on, off = results[("shared-prefix", "continuous", True)], results[("shared-prefix", "continuous", False)]
        print(f"shared-prefix: radix on / off throughput (continuous) = {on['throughput'] / off['throughput']:.2f}x")
    plot(results, args.png)
    print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
