"""One reply from the answers of every replica to a request spread over them (GetInfo,
FlushCache, GetCacheTree with `serve --dp`).

With one replica the answer is the reply, unchanged. With several:
- an error from any replica is the reply;
- Info: `stats` holds each replica's own under "replicas" (in replica order, each with its index
  under "replica") and the router's
  under "router"; at the top, counts (ints) are summed, `cache_hit_rate` is recomputed from the
  summed tokens, `pool_usage` and `kv_usage` are the means, `pool_whole` holds only if it holds everywhere,
  `programs` lists every replica's (each tagged), `slo` sums the counts per priority, a replica's
  own values (`pid`) are under "replicas" only, and any other value is the first replica's;
- FlushDone: ok only if every replica flushed;
- CacheTree: the replicas' nodes one after the other (ids shifted to stay unique), each node and
  request tagged with its "replica".
"""
from __future__ import annotations

import dataclasses
from typing import Any

from stemma import protocol as P


def merge(answers: dict[int, P.Message], router: dict[str, Any] | None) -> P.Message:
    """`answers`: replica -> its answer. `router`: the router's stats (several replicas)."""
    parts = [answers[i] for i in sorted(answers)]
    errors = [p for p in parts if isinstance(p, P.ErrorMsg)]
    if errors:
        return errors[0]
    first = parts[0]
    if len(parts) == 1 and router is None:
        return first
    if isinstance(first, P.Info):
        return dataclasses.replace(first, stats={
            **merge_stats({i: p.stats for i, p in answers.items()}), "router": router})
    if isinstance(first, P.FlushDone):
        return dataclasses.replace(first, ok=all(p.ok for p in parts))
    if isinstance(first, P.CacheTree):
        return _merge_trees(answers)
    return first


OWN = frozenset({"pid"})  # a replica's own, not a count: under "replicas" only


def merge_stats(by_replica: dict[int, dict[str, Any]]) -> dict[str, Any]:
    stats = [by_replica[i] for i in sorted(by_replica)]
    out: dict[str, Any] = {}
    for key, value in stats[0].items():
        values = [s.get(key) for s in stats]
        if key in OWN:
            continue
        if key == "programs" and all(isinstance(v, list) for v in values):  # each one's, tagged
            out[key] = [{**p, "replica": i} for i in sorted(by_replica) for p in by_replica[i][key]]
        elif key == "slo" and all(isinstance(v, dict) for v in values):  # counts per priority
            out[key] = _sum_nested(values)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            out[key] = sum(values)
        elif key in ("pool_usage", "kv_usage") and all(isinstance(v, (int, float)) for v in values):
            out[key] = sum(values) / len(values)
        elif key == "pool_whole":
            out[key] = all(v is True for v in values)
        else:
            out[key] = value
    prompt, cached = out.get("prompt_tokens"), out.get("cached_tokens")
    if isinstance(prompt, int) and isinstance(cached, int):
        out["cache_hit_rate"] = cached / prompt if prompt else 0.0
    # the speculation rates of the summed counts (replica 0's alone were reported)
    proposed, accepted, steps = out.get("spec_proposed"), out.get("spec_accepted"), out.get("spec_steps")
    if isinstance(proposed, int) and isinstance(accepted, int):
        out["spec_acceptance_rate"] = accepted / proposed if proposed else 0.0
    if isinstance(steps, int) and isinstance(accepted, int):
        out["spec_mean_accepted"] = accepted / steps if steps else 0.0
    out["replicas"] = [{"replica": i, **by_replica[i]} for i in sorted(by_replica)]
    return out


def _sum_nested(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """{priority: {count name: n}} dicts, summed key by key."""
    out: dict[str, Any] = {}
    for d in dicts:
        for key, row in d.items():
            mine = out.setdefault(key, {})
            for name, n in row.items():
                mine[name] = mine.get(name, 0) + n if isinstance(n, (int, float)) else n
    return out


def _merge_trees(answers: dict[int, P.CacheTree]) -> P.CacheTree:
    nodes: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    for replica in sorted(answers):
        part = answers[replica]
        shift = len(nodes)
        for node in part.nodes:
            parent = node.get("parent")
            nodes.append({**node, "id": node["id"] + shift,
                          "parent": None if parent is None else parent + shift, "replica": replica})
        requests.extend({**r, "replica": replica} for r in part.requests)
    return dataclasses.replace(answers[min(answers)], nodes=nodes, requests=requests)
