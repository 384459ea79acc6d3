"""Interactive users beside a batch job, with and without latency targets, in the same run.

    python benchmarks/slo.py                      # default model, both runs, then the preemption check
    python benchmarks/slo.py --batch 32 --interactive 4

One in-process engine per run (default model, its default dtype; speculation off, so that every
step is a plain decode or prefill and inter-token gaps are the steps themselves). The workload:
- a batch job: --batch requests submitted at once, random-token prompts of 400-600 tokens,
  64-128 new tokens each, priority 0, no target;
- --interactive closed-loop users: each sends a 16-32-token prompt for 64 new tokens, and when
  it ends, thinks --think-ms and sends the next.
Each run lasts --seconds (or until the batch job is done, if sooner); what is unfinished then
is aborted, and throughput is the tokens generated in the window over its length; beside it, the
tokens processed (prompt tokens computed, less those from the cache, plus generated) over it, as a
run that leaves the batch job's prefills outside its window generates cheap tokens only.
All greedy, EOS ignored. Runs:
- default: no targets, no priorities (what the engine does today);
- slo: the interactive requests carry itl_slo_ms = 2x the machine's one-row decode step (measured
  by the engine's warm-up at load) and priority 1.
The table: the interactive requests' p50/p99 inter-token gap (the engine's own booking times,
pooled over their tokens), how many of them met the target, the total generated tokens/s, the
step-cost model's median absolute error on the run's steps (each predicted before it ran), and how
many batch requests finished in the window. Acceptance (issue 18): slo's interactive p99 <= the target; its total
throughput >= 85% of default's; the model's error <= 20%.

With --presets, the same workload (no per-request targets or priorities: the preset's own
defaults apply to every request) runs under each of `--preset interactive`, `balanced` and
`throughput` instead, and the table shows what each buys.

Then the preemption check: a batch of --max-running priority-0 requests fills the batch, and a
priority-10 request arrives: its first token must come within 2 steps (the median step before it
arrived) plus its own prefill (the same prompt prefilled alone, measured after).
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


def batch_job(rng: random.Random, n: int) -> list[tuple[list[int], int]]:
    return [([rng.randrange(10, 30000) for _ in range(rng.randrange(400, 601))], rng.randrange(64, 129))
            for _ in range(n)]


def run(engine, jobs, users: int, think_s: float, target_ms: float | None, seed: int, seconds: float) -> dict:
    from stemma import SamplingParams
    rng = random.Random(seed)
    batch = [engine.submit(ids, SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True))[0]
             for ids, new in jobs]
    extra = {} if target_ms is None else {"itl_slo_ms": target_ms, "priority": 1}

    def interactive():
        ids = [rng.randrange(10, 30000) for _ in range(rng.randrange(16, 33))]
        return engine.submit(ids, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True, **extra))[0]

    live = [interactive() for _ in range(users)]
    done, wake = [], {}  # user -> time its next request is due
    t0 = time.perf_counter()
    before = engine.stats()
    generated0 = before["generated_tokens"]
    errors_from = len(engine.step_cost.errors)
    while not all(r.finished for r in batch) and time.perf_counter() - t0 < seconds:
        if not engine.step():
            engine.wait_for_work(0.001)
        now = time.perf_counter()
        for i, req in enumerate(live):
            if req is None:
                if now >= wake[i]:
                    live[i] = interactive()
            elif req.finished:
                done.append(req)
                live[i], wake[i] = None, now + think_s
    wall = time.perf_counter() - t0
    after = engine.stats()
    generated = after["generated_tokens"] - generated0
    # prompt tokens computed (admitted, less those from the cache): a run that leaves the batch
    # job's prefills outside its window generates cheap tokens only, and its generated tok/s
    # alone reads high
    prefilled = (after["prompt_tokens"] - after["cached_tokens"]) - (before["prompt_tokens"] - before["cached_tokens"])
    batch_done = sum(1 for r in batch if r.finished)
    for req in live + batch:
        if req is not None and not req.finished:
            engine.abort(req.rid)
    while engine.scheduler.has_work:
        engine.step()
    gaps = [g for r in done for g in r.itl]
    errors = list(engine.step_cost.errors)[errors_from:]
    met = sum(1 for r in done if r.slo and r.slo.get("met"))
    return {"interactive": len(done), "itl_p50_ms": 1e3 * percentile(gaps, 50),
            "itl_p99_ms": 1e3 * percentile(gaps, 99), "met": met,
            "tok_s": generated / wall, "processed_tok_s": (generated + prefilled) / wall,
            "wall_s": wall, "batch_done": batch_done,
            "cost_error": statistics.median(errors) if errors else float("nan"),
            "give_way": engine.stats()["slo_give_way"]}


def preemption(make, max_running: int, seed: int) -> dict:
    from stemma import SamplingParams
    rng = random.Random(seed)
    engine = make(max_running_requests=max_running)
    low = [engine.submit([rng.randrange(10, 30000) for _ in range(200)],
                         SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True))[0]
           for _ in range(max_running)]
    while not all(r.is_decoding for r in low):
        engine.step()
    steps = []
    for _ in range(8):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    prompt = [rng.randrange(10, 30000) for _ in range(64)]
    (urgent,) = engine.submit(prompt, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True,
                                                     priority=10))
    while urgent.first_token_time is None:
        engine.step()
    ttft = urgent.first_token_time - urgent.arrival
    preempted = sum(r.retractions for r in low)
    for r in low:
        engine.abort(r.rid)
    engine.run_until_done([urgent])
    alone = []
    for _ in range(3):  # the same prompt's prefill alone, fresh tokens each time (no cache hit)
        ids = [rng.randrange(10, 30000) for _ in range(64)]
        t = time.perf_counter()
        engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=1))
        alone.append(time.perf_counter() - t)
    engine.check_pool_whole()
    step, prefill = statistics.median(steps), statistics.median(alone)
    return {"ttft_ms": 1e3 * ttft, "step_ms": 1e3 * step, "prefill_ms": 1e3 * prefill,
            "bound_ms": 1e3 * (2 * step + prefill), "preempted": preempted}


def compare_presets(make, jobs, args) -> None:
    rows = []
    for preset in ("throughput", "balanced", "interactive"):
        engine = make(preset=preset)
        print(f"preset {preset}: running ...", file=sys.stderr, flush=True)
        r = run(engine, jobs, args.interactive, args.think_ms / 1e3, None, args.seed + 1, args.seconds)
        cfg = engine.config
        rows.append([preset, cfg.max_running_requests, cfg.chunked_prefill_size,
                     f"{1e3 * cfg.default_itl_slo_steps * engine.scheduler.slo.one_row_s:.0f} ms" if cfg.default_itl_slo_steps else "-",
                     r["interactive"], r["itl_p50_ms"], r["itl_p99_ms"], r["tok_s"], f"{r['batch_done']}/{args.batch}"])
        del engine
    print(f"default model; batch job: {args.batch} requests, prompts 400-600 tokens, 64-128 new; "
          f"{args.interactive} interactive users (16-32-token prompts, 64 new, think {args.think_ms:g} ms); "
          f"greedy, speculation off; no per-request targets or priorities")
    print(table(["preset", "max running", "chunk", "itl target", "interactive reqs", "itl p50 ms",
                 "itl p99 ms", "total tok/s", "batch finished"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--interactive", type=int, default=8)
    ap.add_argument("--think-ms", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=90.0, help="each run's window")
    ap.add_argument("--max-running", type=int, default=16, help="the preemption check's full batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--presets", action="store_true", help="compare the engine presets instead")
    args = ap.parse_args()

    import stemma

    def make(**options):
        return stemma.Engine(kv_pool_tokens=65536, speculative="none", **options)

    jobs = batch_job(random.Random(args.seed), args.batch)
    if args.presets:
        compare_presets(make, jobs, args)
        return
    results, target = {}, None
    for name in ("default", "slo"):
        engine = make()
        engine.warm_up_step_cost()  # both runs start with a seeded model; `slo` reads its step
        if name == "slo":
            target = 2e3 * engine.scheduler.slo.one_row_s
        print(f"{name}: running ...", file=sys.stderr, flush=True)
        results[name] = run(engine, jobs, args.interactive, args.think_ms / 1e3,
                            target if name == "slo" else None, args.seed + 1, args.seconds)
        results[name]["one_row_ms"] = 1e3 * engine.scheduler.slo.one_row_s
        del engine
    base = results["default"]["tok_s"]
    base_processed = results["default"]["processed_tok_s"]
    print(f"default model; batch job: {args.batch} requests, prompts 400-600 tokens, 64-128 new; "
          f"{args.interactive} interactive users (16-32-token prompts, 64 new, think {args.think_ms:g} ms); "
          f"greedy, speculation off; {args.seconds:g} s a run; itl target of the slo run: {target:.1f} ms "
          f"(2x the one-row decode step, {target / 2:.1f} ms)")
    rows = []
    for name, r in results.items():
        rows.append([name, r["interactive"], r["itl_p50_ms"], r["itl_p99_ms"],
                     f"{r['met']}/{r['interactive']}" if name == "slo" else "-", r["tok_s"],
                     f"{r['tok_s'] / base:.3f}", r["processed_tok_s"], f"{r['processed_tok_s'] / base_processed:.3f}",
                     r["cost_error"], f"{r['batch_done']}/{args.batch}", r["give_way"]])
    print(table(["run", "interactive reqs", "itl p50 ms", "itl p99 ms", "met target", "total tok/s",
                 "vs default", "processed tok/s", "vs default", "cost model error", "batch finished",
                 "gave way"], rows))
    slo = results["slo"]
    print(f"slo: interactive p99 {slo['itl_p99_ms']:.1f} ms vs target {target:.1f} ms: "
          f"{'ok' if slo['itl_p99_ms'] <= target else 'MISSED'}; throughput {slo['tok_s'] / base:.1%} of "
          f"default: {'ok' if slo['tok_s'] >= 0.85 * base else 'BELOW 85%'} (prompt and generated tokens "
          f"processed: {slo['processed_tok_s'] / base_processed:.1%} of default's: "
          f"{'ok' if slo['processed_tok_s'] >= 0.85 * base_processed else 'BELOW 85%'}); cost model error "
          f"{slo['cost_error']:.1%}: {'ok' if slo['cost_error'] <= 0.2 else 'ABOVE 20%'}")
    p = preemption(make, args.max_running, args.seed + 2)
    print(f"preemption: {args.max_running} running priority-0 requests, a priority-10 request of 64 tokens "
          f"arrives: first token after {p['ttft_ms']:.1f} ms; bound 2 x {p['step_ms']:.1f} ms step + "
          f"{p['prefill_ms']:.1f} ms prefill alone = {p['bound_ms']:.1f} ms: "
          f"{'ok' if p['ttft_ms'] <= p['bound_ms'] else 'MISSED'}; {p['preempted']} request(s) preempted; pool whole")


if __name__ == "__main__":
    main()
