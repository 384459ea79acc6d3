"""Cache-aware routing over data-parallel replicas vs round robin, in one run.

    python benchmarks/routing.py                 # default model, --dp 2, one thread per replica

Each run starts a fresh `stemma.Runtime(dp=2)` on the default model (its default dtype and
speculation; the one-row decode compile off, so that no background compile lands in one run and
not another): two engine processes, each pinned to one core with one thread, behind one gateway.
Runs, in this order:
- cache_aware, exact tree: the router follows each replica's radix tree through its insert and
  evict events;
- cache_aware, approximate tree: the router knows only the prompts it sent (SGLang's router);
- round_robin.

The workload, deterministic from --seed: --tenants tenants (16), each with its own system prompt
of exactly --system-tokens tokens (800) of English-like text, and --requests requests (256), each
a tenant's system prompt, then a question of its own (--query-tokens, 32), greedy, exactly
--gen-tokens new tokens (16, EOS ignored). The requests are interleaved across tenants: they
come in rounds, each round one request per tenant in a fresh random order. --concurrency clients
(16) send them in that order, each its next request as soon as its last one returned (a closed
loop).

Each replica's KV pool holds --kv-pool-tokens tokens (default: 9 tenants' requests): the
16 tenants' prompts fit in the two pools together, not in one, which is where routing matters.

Reported per run: the prefix hit rate (the replicas' cached over prompt tokens, summed, in the
timed part), throughput (generated tokens over the wall time of the timed part), p50 latency per
request, requests per replica and the router's reasons. Then the verdicts, cache_aware (exact)
vs round_robin: hit rate >= 3x and throughput >= 1.5x. Then the exact-vs-approximate comparison:
the approximate run's own figures, and, from the exact run, how the approximate tree's matched
tokens differ from the exact tree's over every routing decision (over: it thought cached what
was not; under: it missed what was) and how often the two would have picked different replicas.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agents import prose  # noqa: E402
from common import table  # noqa: E402

import stemma  # noqa: E402
from stemma.loader.gguf.loader import default_model_path  # noqa: E402
from stemma.serve.router import Routing  # noqa: E402
from stemma.text.tokenizer import load_tokenizer  # noqa: E402

RUNS = [("cache_aware", "exact"), ("cache_aware", "approximate"), ("round_robin", "exact")]


def workload(args, tokenizer) -> tuple[list[list[int]], list[int]]:
    """The prompts (token ids) in sending order, and each one's tenant."""
    rng = random.Random(args.seed)

    def tokens(text: str, n: int) -> list[int]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < n:
            ids += tokenizer.encode(" " + prose(rng, n), add_special_tokens=False)
        return ids[:n]

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    systems = [bos + tokens(f"You are the assistant of tenant {t + 1}. " + prose(rng, args.system_tokens),
                            args.system_tokens) for t in range(args.tenants)]
    prompts, tenants = [], []
    while len(prompts) < args.requests:
        order = list(range(args.tenants))
        rng.shuffle(order)
        for t in order[:args.requests - len(prompts)]:
            prompts.append(systems[t] + tokens("\n\nQuestion: " + prose(rng, args.query_tokens),
                                               args.query_tokens))
            tenants.append(t)
    return prompts, tenants


async def drive(client, prompts, args) -> list[float]:
    params = {"temperature": 0.0, "max_new_tokens": args.gen_tokens, "ignore_eos": True}
    queue = list(enumerate(prompts))[::-1]
    latencies = [0.0] * len(prompts)

    async def worker():
        while queue:
            i, prompt = queue.pop()
            start = time.perf_counter()
            out = await client.agenerate(prompt, params, timeout=600)
            assert len(out.token_ids) == args.gen_tokens
            latencies[i] = time.perf_counter() - start

    await asyncio.gather(*[worker() for _ in range(args.concurrency)])
    return latencies


def run(policy: str, tree: str, prompts, args) -> dict:
    routing = Routing(router=policy, cache_tree=tree)
    with stemma.Runtime(args.model, dp=args.dp, routing=routing, kv_pool_tokens=args.kv_pool_tokens,
                        compile_decode="off", start_timeout=900) as rt:
        client = rt.client
        for i in range(2 * args.dp):  # warm-up: every replica runs a request, then forgets it
            client.generate([i + 10, 20, 30, 40], {"max_new_tokens": 4, "temperature": 0.0})
        assert client.flush_cache()
        before = client.info()["stats"]
        start = time.perf_counter()
        latencies = asyncio.run(drive(client, prompts, args))
        wall = time.perf_counter() - start
        after = client.info()["stats"]
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    generated = after["generated_tokens"] - before["generated_tokens"]
    router_before, router_after = before["router"], after["router"]
    return {"policy": policy, "tree": tree, "hit": cached / prompt, "tok_s": generated / wall,
            "wall": wall, "p50": statistics.median(latencies),
            "routed": [a - b for a, b in zip(router_after["routed"], router_before["routed"])],
            "reasons": {k: v - router_before["reasons"].get(k, 0)
                        for k, v in router_after["reasons"].items()},
            "compare": {k: v - router_before["tree"][k] for k, v in router_after["tree"].items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=800)
    ap.add_argument("--query-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kv-pool-tokens", type=int, default=None,
                    help="per replica (default: 9 requests' worth of tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=",".join(f"{p}:{t}" for p, t in RUNS),
                    help="policy:tree pairs, comma-separated")
    args = ap.parse_args()
    per_request = 1 + args.system_tokens + args.query_tokens + args.gen_tokens
    if args.kv_pool_tokens is None:
        args.kv_pool_tokens = 9 * per_request
    tokenizer = load_tokenizer(args.model or default_model_path())
    prompts, tenants = workload(args, tokenizer)
    print(f"{len(prompts)} requests over {args.tenants} tenants ({args.system_tokens}-token system "
          f"prompts, {args.query_tokens}-token questions, {args.gen_tokens} new tokens each), "
          f"--dp {args.dp}, {args.concurrency} clients, KV pool {args.kv_pool_tokens} tokens per "
          f"replica", flush=True)
    results = {}
    for pair in args.runs.split(","):
        policy, tree = pair.split(":")
        results[pair] = r = run(policy, tree, prompts, args)
        print(f"  {policy} ({tree}): hit {r['hit']:.1%}, {r['tok_s']:.1f} tok/s, {r['wall']:.1f} s",
              flush=True)
    rows = [[r["policy"], r["tree"] if r["policy"] == "cache_aware" else "-", f"{r['hit']:.1%}",
             f"{r['tok_s']:.1f}", f"{r['wall']:.1f}", f"{r['p50']:.2f}",
             "/".join(map(str, r["routed"])), ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))]
            for r in results.values()]
    print(table(["router", "tree", "hit rate", "tok/s", "wall s", "p50 s", "per replica", "reasons"], rows))
    exact, rr = results.get("cache_aware:exact"), results.get("round_robin:exact")
    ok = True
    if exact and rr:
        hit_x = exact["hit"] / rr["hit"] if rr["hit"] else float("inf")
        tput_x = exact["tok_s"] / rr["tok_s"]
        for name, value, bound in (("hit rate", hit_x, 3.0), ("throughput", tput_x, 1.5)):
            verdict = "PASS" if value >= bound else "FAIL"
            ok &= value >= bound
            print(f"cache_aware vs round_robin, {name}: {value:.2f}x (needs >= {bound:g}x) {verdict}")
    approx = results.get("cache_aware:approximate")
    if exact:
        c = exact["compare"]
        if c["compared"]:
            print(f"exact vs approximate tree, over the exact run's {c['compared']} cache-aware "
                  f"decisions: the approximate tree matched {c['approx_matched']} tokens where the "
                  f"exact one matched {c['exact_matched']} ({c['approx_over']} over, "
                  f"{c['approx_under']} under), and would have picked another replica "
                  f"{c['choice_differs']} times")
        if approx:
            print(f"approximate-tree run: hit {approx['hit']:.1%} vs exact {exact['hit']:.1%}, "
                  f"{approx['tok_s']:.1f} vs {exact['tok_s']:.1f} tok/s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
