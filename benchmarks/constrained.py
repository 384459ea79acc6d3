"""Constrained decoding on the default model: the cost of the masks, and what jump-forward saves.

One engine, one process, after a warm-up (every Index is built and cached before timing; the cold
build time per schema is printed too). All requests are greedy.

1. Mask overhead: a batch of B JSON-schema requests (jump-forward off, so every token is sampled
   under a mask), a batch of B plain requests that generate exactly as many tokens each as the JSON
   ones did (same steps, same batch size at every step), and both together in one batch of 2B.
   Reported: steps, tokens, wall time, tokens/s, ms per step, and the time spent filling and
   applying the masks.
2. Jump-forward: the same B JSON-schema requests with jump-forward off and on: steps, sampled and
   forced tokens, wall time.

Each configuration runs --rounds times, interleaved, and the fastest round is reported (other
processes share the CPU). The JSON outputs' lengths are printed as their distribution.

    python benchmarks/constrained.py [--batch 32] [--rounds 2] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "hiking", "music"]}, "maxItems": 2}},
     "required": ["name", "age", "hobbies"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "login": {"type": "string", "maxLength": 10}}, "required": ["id", "login"]},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]}},
     "required": ["user", "active", "role"]},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20},
        "date": {"type": "string", "format": "date"},
        "priority": {"enum": ["low", "medium", "high"]},
        "attendees": {"type": "integer", "minimum": 1, "maximum": 50}},
     "required": ["title", "date", "priority", "attendees"]},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 14},
        "coords": {"type": "object", "properties": {
            "latitude": {"type": "integer", "minimum": -90, "maximum": 90},
            "longitude": {"type": "integer", "minimum": -180, "maximum": 180}},
            "required": ["latitude", "longitude"]},
        "capital": {"type": "boolean"}},
     "required": ["city", "coords", "capital"]},
]
KINDS = ["person", "user account", "meeting", "city"]
NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jules", "Kofi",
         "Lena", "Mateo", "Nour", "Olga", "Pavel"]


def json_workload(batch: int, max_new_tokens: int):
    from stemma import SamplingParams
    prompts, params = [], []
    for i in range(batch):
        k = i % len(SCHEMAS)
        prompts.append(f"A JSON record describing the {KINDS[k]} '{NAMES[i // len(SCHEMAS) % len(NAMES)]}':\n")
        params.append(SamplingParams(json_schema=SCHEMAS[k], temperature=0, max_new_tokens=max_new_tokens))
    return prompts, params


def plain_workload(lengths: list[int]):
    """Plain requests that generate exactly `lengths[i]` tokens each."""
    from stemma import SamplingParams
    prompts = [f"A short story about {NAMES[i % len(NAMES)]} and the number {i}:" for i in range(len(lengths))]
    return prompts, [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lengths]


def run(engine, prompts, params, jump_forward: bool) -> dict:
    """Runs one batch to completion; the engine's counters are read before and after."""
    constrainer = engine.scheduler.constrainer
    constrainer.enable_jump_forward = jump_forward  # per-engine switch, flipped between runs here
    assert engine.flush_cache()
    before = (engine.stats()["steps"], constrainer.stats.mask_time, constrainer.stats.forced_tokens,
              constrainer.stats.guided_tokens)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    stats = engine.stats()
    steps = stats["steps"] - before[0]
    for out, p in zip(outs, params):
        if p.json_schema is not None:
            json.loads(out.text)  # parses (validity is asserted by the tests)
    lengths = [len(o.token_ids) for o in outs]
    return {"steps": steps, "tokens": sum(lengths), "wall": wall, "lengths": lengths,
            "mask": constrainer.stats.mask_time - before[1],
            "forced": constrainer.stats.forced_tokens - before[2],
            "sampled": constrainer.stats.guided_tokens - before[3]}


def build_indexes(engine, params) -> list[float]:
    constrainer = engine.scheduler.constrainer
    times = []
    for p in params:
        t0 = time.perf_counter()
        constrainer.start(constrainer.check(p)).result()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    import stemma
    engine = stemma.Engine(dtype=args.dtype, max_running_requests=2 * args.batch)
    json_prompts, json_params = json_workload(args.batch, 192)
    builds = build_indexes(engine, json_params[:len(SCHEMAS)])  # cold: vocabulary + one Index each
    run(engine, json_prompts[:8], json_params[:8], jump_forward=True)  # warm-up: decodes and extends
    lengths = run(engine, json_prompts, json_params, jump_forward=False)["lengths"]
    plain_prompts, plain_params = plain_workload(lengths)

    configs = {
        "plain": (plain_prompts, plain_params, False),
        "json": (json_prompts, json_params, False),
        "mixed": (plain_prompts + json_prompts, plain_params + json_params, False),
        "json_jump": (json_prompts, json_params, True),
    }
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, (prompts, params, jump) in configs.items():
            result = run(engine, prompts, params, jump)
            if name not in best or result["wall"] < best[name]["wall"]:
                best[name] = result

    def row(name, r):
        return [name, r["steps"], r["tokens"], r["wall"], r["tokens"] / r["wall"],
                1e3 * r["wall"] / r["steps"], 1e3 * r["mask"] / r["steps"]]
    b = args.batch
    print(f"default model, dtype {args.dtype}, {torch.get_num_threads()} threads, greedy, "
          f"best of {args.rounds} rounds; Index builds (the first includes the vocabulary): "
          + ", ".join(f"{t:.2f}s" for t in builds))
    print(f"\n1. mask overhead: {b} JSON-schema requests (jump-forward off) vs {b} plain requests "
          f"of the same lengths (output tokens min/median/max {min(lengths)}/"
          f"{statistics.median(lengths):.0f}/{max(lengths)})")
    print(table(["batch", "steps", "tokens", "wall (s)", "tokens/s", "ms/step", "mask ms/step"],
                [row(f"{b} plain", best["plain"]), row(f"{b} JSON schema", best["json"]),
                 row(f"{b} + {b} in one batch", best["mixed"])]))
    ratio = best["json"]["wall"] / best["plain"]["wall"]
    print(f"constrained / plain wall time: {ratio:.2f}x")

    print(f"\n2. jump-forward on {b} JSON-schema requests")
    off, on = best["json"], best["json_jump"]
    rows = [[name, r["steps"], r["sampled"], r["forced"], r["tokens"], r["wall"]]
            for name, r in (("off", off), ("on", on))]
    rows.append(["off / on", off["steps"] / on["steps"], "", "", "", off["wall"] / on["wall"]])
    print(table(["jump-forward", "steps", "sampled", "forced", "tokens", "wall (s)"], rows))


if __name__ == "__main__":
    main()
