"""Programs that share a few-shot prefix: run_batch with the radix cache on vs off.

Workload: N programs (64 by default). Each is a few-shot prefix of about 1,000 tokens (worked
examples, "Q: What number comes after 41?\\nA: 42"), then its own question, then one greedy gen of at most 4
tokens that stops at the end of the line (so outputs are 1-4 tokens, nearly uniform). Both runs
use the default model on an in-process engine, in this process, after a warm-up on a different
prefix; the only difference is `enable_radix_cache`. run_batch traces the program, prefills its
constant prefix once, and runs the programs concurrently.

Prints the wall time of each run, the share of the N programs' prefix tokens that the cache
served, the outputs' agreement, and the speed-up.

    python benchmarks/programs.py [--programs 64] [--prefix-tokens 1000] [--max-new-tokens 4]
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

import stemma  # noqa: E402
from stemma.lang.backends.engine import EngineBackend  # noqa: E402


def shots(tokenizer, tokens: int, seed: int) -> str:
    """Worked examples until the text holds at least `tokens` tokens."""
    rng = random.Random(seed)
    text = "Answer each question with a number.\n\n"
    while len(tokenizer(text).input_ids) < tokens:
        n = rng.randint(10, 998)
        text += f"Q: What number comes after {n}?\nA: {n + 1}\n\n"
    return text


def make_program(prefix: str, max_new_tokens: int):
    @stemma.function
    def solve(s, n):
        s += prefix
        s += f"Q: What number comes after {n}?\nA:"
        s += stemma.gen("answer", max_new_tokens=max_new_tokens, stop="\n", temperature=0)
    return solve


def run(radix: bool, args) -> dict:
    engine = stemma.Engine(enable_radix_cache=radix, kv_pool_tokens=args.kv_pool_tokens,
                           max_running_requests=args.programs)
    backend = EngineBackend(engine)
    rng = random.Random(0)
    batch = [{"n": rng.randint(10, 998)} for _ in range(args.programs)]
    warm = make_program(shots(engine.tokenizer, 200, seed=99), args.max_new_tokens)
    warm.run_batch(batch[:4], backend=backend)
    assert engine.flush_cache()
    program = make_program(shots(engine.tokenizer, args.prefix_tokens, seed=1), args.max_new_tokens)
    start = time.perf_counter()
    states = program.run_batch(batch, backend=backend, max_concurrency=args.programs)
    elapsed = time.perf_counter() - start
    prefix = states.prefill.prompt_tokens
    served = sum(min(s.calls()[0].cached_tokens, prefix) for s in states)
    engine.check_pool_whole()
    out = {"elapsed": elapsed, "prefix": prefix, "served": served / (prefix * len(states)),
           "answers": [s["answer"] for s in states], "stats": engine.stats(),
           "dtype": str(next(engine.loaded.model.parameters()).dtype).replace("torch.", ""),
           "correct": sum(s["answer"].strip() == str(b["n"] + 1) for s, b in zip(states, batch))}
    del states, program, backend, engine
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--kv-pool-tokens", type=int, default=100_000)
    args = ap.parse_args()
    on = run(True, args)
    off = run(False, args)
    rows = [[name, r["prefix"], f"{r['served']:.1%}", r["stats"]["prompt_tokens"], r["stats"]["cached_tokens"],
             r["elapsed"], f"{r['correct']}/{args.programs}"] for name, r in (("radix on", on), ("radix off", off))]
    agree = sum(a == b for a, b in zip(on["answers"], off["answers"]))
    print(f"{args.programs} programs, a {on['prefix']}-token few-shot prefix each, "
          f"greedy gen of <= {args.max_new_tokens} tokens (stop at newline), default model")
    print(table(["cache", "prefix tokens", "prefix served from cache", "prompt tokens", "cached tokens",
                 "wall s", "correct answers"], rows))
    print(f"outputs identical with the cache on and off: {agree}/{args.programs} "
          f"(in {on['dtype']}, a cached prefix and a full prefill round differently)")
    print(f"speed-up with the radix cache: {off['elapsed'] / on['elapsed']:.2f}x")


if __name__ == "__main__":
    main()
