"""The best hit-rate ratio any router could show on routing.py's workload, from a model of it.

    python benchmarks/routing_bound.py            # 16 tenants, 256 requests, 2 replicas
    python benchmarks/routing_bound.py --replicas 4 --seeds 200

No model runs. routing.py's workload is replayed as tenant ids: --requests requests in rounds,
each round one request per tenant (--tenants) in a fresh random order. Each replica's cache is
an ideal LRU over the tenants' system prompts holding C of them (C whole prompts, no partial
hits, no request's own tokens, nothing locked by requests in flight: each of those only lowers
the hit rates the engine can reach). Two routers:
- round_robin: request i goes to replica i mod --replicas;
- sticky: a tenant's requests all go to the replica it was first given (tenants spread evenly),
  what cache_aware does when no load imbalance makes it route by load.

For each C it prints both hit rates (requests whose system prompt was cached, the mean over
--seeds orders) and their ratio. The hit rate in prompt tokens is each figure times the system
prompt's share of a prompt, the same for both, so the ratio is the same.
"""
from __future__ import annotations

import argparse
import random
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402


def rounds(rng: random.Random, tenants: int, requests: int) -> list[int]:
    order: list[int] = []
    while len(order) < requests:
        shuffled = list(range(tenants))
        rng.shuffle(shuffled)
        order += shuffled
    return order[:requests]


def hit_rate(order: list[int], replicas: int, capacity: int, sticky: bool) -> float:
    caches = [OrderedDict() for _ in range(replicas)]
    home: dict[int, int] = {}
    hits = 0
    for i, tenant in enumerate(order):
        if sticky:
            r = home.setdefault(tenant, len(home) % replicas)
        else:
            r = i % replicas
        cache = caches[r]
        if tenant in cache:
            hits += 1
            cache.move_to_end(tenant)
        else:
            cache[tenant] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / len(order)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=100)
    args = ap.parse_args(argv)
    orders = [rounds(random.Random(seed), args.tenants, args.requests) for seed in range(args.seeds)]
    rows, best = [], (0.0, 0)
    for capacity in range(1, args.tenants + 1):
        rr = sum(hit_rate(o, args.replicas, capacity, sticky=False) for o in orders) / len(orders)
        st = sum(hit_rate(o, args.replicas, capacity, sticky=True) for o in orders) / len(orders)
        ratio = st / rr if rr else float("inf")
        if rr and ratio > best[0]:
            best = (ratio, capacity)
        rows.append([capacity, f"{100 * rr:.1f}%", f"{100 * st:.1f}%", "-" if not rr else f"{ratio:.2f}x"])
    print(f"{args.tenants} tenants, {args.requests} requests in rounds of one per tenant in random order, "
          f"{args.replicas} replicas, ideal LRU of C system prompts each; mean over {args.seeds} orders")
    print(table(["C", "round_robin", "sticky", "ratio"], rows))
    print(f"highest ratio where round robin hits at all: {best[0]:.2f}x, at C = {best[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
