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
3. Budget closure (constraint_budget_closure), on vs off on the same engine, interleaved, jump-
   forward on: B JSON-schema requests with unbounded integers, numbers, strings and arrays at
   max_new_tokens 192 ("roomy": closure acts only on the outputs that run into the budget) and at
   1.5x each schema's shortest output ("tight": it acts on most), and B Lark-grammar requests.
   Reported per configuration: steps, ms/step, mask ms/step (fill + closure + apply), closure
   ms/step (its share of it), invalid outputs, and the cold cost of the closure tables (built
   with each Index, on the worker thread).

Each configuration runs --rounds times, interleaved, and the fastest round is reported (other
processes share the CPU). The JSON outputs' lengths are printed as their distribution.

    python benchmarks/constrained.py [--batch 32] [--rounds 2] [--dtype bfloat16] [--only closure]
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
_S, _I, _N, _B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _obj(**props):
    return {"type": "object", "properties": props, "required": list(props)}


# Unbounded values: the schemas whose outputs run into max_new_tokens without closure.
OPEN_SCHEMAS = [
    _obj(name=_S, age=_I), _obj(title=_S, year=_I, rating=_N), _obj(id=_I, tags={"type": "array", "items": _S}),
    _obj(city=_S, population=_I, area=_N), _obj(scores={"type": "array", "items": _I}),
    _obj(user=_obj(id=_I, login=_S), active=_B), _obj(product=_S, price=_N, stock=_I), _obj(lat=_N, lon=_N),
]
OPEN_KINDS = ["person", "film", "record", "city", "exam", "account", "product", "place"]
CLOSURE_GRAMMAR = '''start: expr
expr: term (ADD term)*
term: factor (MUL factor)*
factor: NUMBER | "(" expr ")"
ADD: "+" | "-"
MUL: "*" | "/"
NUMBER: /[0-9]+/
'''
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


def run(engine, prompts, params, jump_forward: bool, closure: bool = True, check: bool = True) -> dict:
    """Runs one batch to completion; the engine's counters are read before and after."""
    constrainer = engine.scheduler.constrainer
    constrainer.enable_jump_forward = jump_forward  # per-engine switches, flipped between runs here
    constrainer.budget_closure = closure
    assert engine.flush_cache()
    s = constrainer.stats
    before = (engine.stats()["steps"], s.mask_time, s.forced_tokens, s.guided_tokens, s.closure_time,
              s.closed_requests)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    stats = engine.stats()
    steps = stats["steps"] - before[0]
    invalid = sum(not valid(out.text, p) for out, p in zip(outs, params))
    if check:
        assert not invalid, f"{invalid} outputs do not hold their constraint"
    lengths = [len(o.token_ids) for o in outs]
    return {"steps": steps, "tokens": sum(lengths), "wall": wall, "lengths": lengths,
            "mask": s.mask_time - before[1], "forced": s.forced_tokens - before[2],
            "sampled": s.guided_tokens - before[3], "closure": s.closure_time - before[4],
            "closed": s.closed_requests - before[5], "invalid": invalid}


def valid(text: str, params) -> bool:
    """Whether an output holds its constraint (plain outputs always do)."""
    try:
        if params.json_schema is not None:
            import jsonschema
            jsonschema.validate(json.loads(text), json.loads(params.json_schema))
        elif params.grammar is not None:
            import lark
            lark.Lark(params.grammar).parse(text)
    except Exception:
        return False
    return True


def build_indexes(engine, params) -> list[float]:
    constrainer = engine.scheduler.constrainer
    times = []
    for p in params:
        t0 = time.perf_counter()
        constrainer.start(constrainer.check(p)).result()
        times.append(time.perf_counter() - t0)
    return times


def closure_section(engine, batch: int, rounds: int) -> None:
    """3. budget closure on vs off, interleaved on one engine."""
    from stemma import SamplingParams
    constrainer = engine.scheduler.constrainer
    constrainer.budget_closure = True
    prompts, shortest, built = [], [], []
    for i in range(batch):
        k = i % len(OPEN_SCHEMAS)
        prompts.append(f"A JSON record describing a {OPEN_KINDS[k]} ({NAMES[i // len(OPEN_SCHEMAS) % len(NAMES)]}):\n")
    for schema in OPEN_SCHEMAS:
        spec = constrainer.check(SamplingParams(json_schema=schema))
        t0 = time.perf_counter()
        constrainer.start(spec).result()
        table_ = constrainer.indexes.lookup_closure(spec.source, constrainer.vocab().fingerprint)
        built.append((time.perf_counter() - t0, table_.seconds, table_.edges))
        shortest.append(table_.distance(table_.initial))
    schemas = [OPEN_SCHEMAS[i % len(OPEN_SCHEMAS)] for i in range(batch)]
    roomy = [SamplingParams(json_schema=s, temperature=0, max_new_tokens=192) for s in schemas]
    tight = [SamplingParams(json_schema=s, temperature=0, max_new_tokens=int(1.5 * shortest[i % len(OPEN_SCHEMAS)]))
             for i, s in enumerate(schemas)]
    g_prompts = [f"An arithmetic expression using {i + 2} numbers: " for i in range(batch)]
    grammar = [SamplingParams(grammar=CLOSURE_GRAMMAR, temperature=0, max_new_tokens=24 + i % 8) for i in range(batch)]
    constrainer.start(constrainer.check(grammar[0])).result()
    workloads = {"JSON, roomy budget": (prompts, roomy), "JSON, tight budget": (prompts, tight),
                 "grammar": (g_prompts, grammar)}
    for name, (p, params) in workloads.items():  # warm-up
        run(engine, p[:4], params[:4], True, True, check=False)
    best: dict[tuple[str, bool], dict] = {}
    for _ in range(rounds):
        for name, (p, params) in workloads.items():
            for closure in (False, True):
                result = run(engine, p, params, True, closure, check=False)
                key = (name, closure)
                if key not in best or result["wall"] / result["steps"] < best[key]["wall"] / best[key]["steps"]:
                    best[key] = result
    print(f"\n3. budget closure, {batch} requests each, jump-forward on, best of {rounds} rounds "
          f"(by ms/step); shortest outputs of the {len(OPEN_SCHEMAS)} schemas: {shortest} tokens")
    rows = []
    for name in workloads:
        off, on = best[(name, False)], best[(name, True)]
        for label, r in (("off", off), ("on", on)):
            rows.append([name, label, r["steps"], r["tokens"], 1e3 * r["wall"] / r["steps"],
                         1e3 * r["mask"] / r["steps"], 1e3 * r["closure"] / r["steps"], r["closed"],
                         f"{r['invalid']}/{len(workloads[name][1])}"])
        step_ratio = (on["wall"] / on["steps"]) / (off["wall"] / off["steps"])
        mask_ratio = (on["mask"] / on["steps"]) / (off["mask"] / off["steps"])
        rows.append([name, "on / off", "", "", step_ratio, mask_ratio, "", "", ""])
    print(table(["workload", "closure", "steps", "tokens", "ms/step", "mask ms/step", "closure ms/step",
                 "closed", "invalid"], rows))
    print("closure tables (cold, on the worker thread, beside each Index): "
          + ", ".join(f"{t:.2f}s of {total:.2f}s ({edges / 1e6:.1f}M transitions)" for total, t, edges in built))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--only", choices=["closure"], default=None, help="run section 3 only")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    import stemma
    # the decode compile off: under `auto` it would compile the 32- and 64-row graphs during a
    # measured round, so that the best-of-2 rounds could mix compiled and eager steps
    engine = stemma.Engine(dtype=args.dtype, max_running_requests=2 * args.batch, compile_decode="off")
    if args.only == "closure":
        print(f"default model, dtype {args.dtype}, {torch.get_num_threads()} threads, greedy")
        closure_section(engine, args.batch, args.rounds)
        return
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

    closure_section(engine, b, args.rounds)


if __name__ == "__main__":
    main()
