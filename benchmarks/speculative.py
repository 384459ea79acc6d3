"""Speculative decoding on versus off, in process, on the default model, in the same run.

    python benchmarks/speculative.py                                 # default model, ngram, 2 rounds
    python benchmarks/speculative.py --quick                         # 1 round, smaller workloads
    python benchmarks/speculative.py --rounds 3 --speculative-max-tokens 6
    python benchmarks/speculative.py --model DIR --dtype float32 --attention-backend torch   # any EngineConfig flag

Two Engines of the same model and flags live in this process, created once and warmed up once:
`on` with `speculative=--speculative` (default ngram: prompt-lookup drafts verified inside the
continuous batch) and `off` with `speculative=none`. Each engine is driven by its own closed loop
(`engine.submit` + `engine.step`): at concurrency C, C requests are in flight and a new one is
submitted as soon as one finishes. At every level the two take turns `--rounds` times (off, on,
on, off, ...; the first side alternates from level to level too), on the same requests, and both
radix caches are flushed (`engine.flush_cache()`) before every run, so no run reuses a prompt or
a cached continuation from an earlier one (n-gram drafts are also looked up in the radix tree's
cached continuations, so an unflushed tree would feed the `on` side the previous round's answer).

Workloads (prompts are built from the docstrings of the local Python standard library, read with
`ast`, nothing imported or downloaded; seeded, the same every run on one Python):
  copy   extraction and editing of text given in the prompt ("Copy the following paragraph
         exactly", "Rewrite ... replacing 'the' with 'a'", ...), each over a distinct docstring
         passage of 1.25-3 x --copy-len tokens, so a base model continues by copying and
         n-gram drafts hit often. Greedy, --copy-len new tokens at most, stopping at EOS as the
         model pleases (tokens are counted exactly, from the output ids). Concurrency 1 and 4.
  free   free generation: a distinct first sentence of a docstring as the prompt, greedy,
         EOS ignored, output lengths uniform in --free-len (8-128; seeded, the same per side),
         so each request generates exactly its length. Concurrency 1, 16 and 64.

Metrics, per side and level (summed over its rounds): decode tok/s = generated tokens / the
level's wall time (prefill included, as a user sees it); the on/off ratio of that, also per round;
from the `on` engine's stats deltas over its runs: the draft acceptance rate (accepted / proposed
draft tokens), the mean accepted drafts per speculating request-step (accepted / spec_steps), and
tok/step = generated tokens / engine steps (1.0 at concurrency 1 without speculation).
`foreign` is the cores that processes outside this one used meanwhile (other work on the
machine). Acceptance: copy at concurrency 1 must reach >= 1.8x; free generation must keep
>= 0.97x at every concurrency. A correctness guard compares the greedy output ids of the two
sides, request by request, in every round (and, given 2+ rounds, each side with itself across
rounds, the noise floor of batch composition and numerics).
"""
from __future__ import annotations

import argparse
import ast
import random
import re
import sys
import sysconfig
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CpuAudit, table  # noqa: E402

from stemma.cli_args import add_dataclass_args, collect  # noqa: E402
from stemma.engine_config import EngineConfig  # noqa: E402

COPY_ACCEPT = 1.8   # copy, concurrency 1: on / off decode tok/s must reach this
FREE_ACCEPT = 0.97  # free generation: on / off at every concurrency must reach this
DISTURBED_CORES = 0.2  # a run during which other processes used more is flagged
KV_POOL_TOKENS = 32768  # per engine (two live at once); the workloads need < 16k
COPY_TEMPLATES = (
    "Copy the following paragraph exactly.\n\n{text}\n\nCopy:\n",
    "Rewrite the text below, replacing every 'the' with 'a'.\n\nText:\n{text}\n\nResult:\n",
    "Quote the passage below verbatim.\n\nPassage:\n{text}\n\nQuote:\n",
    "Fix any typos in the following text and repeat it in full.\n\n{text}\n\nCorrected text:\n",
)


@dataclass(frozen=True)
class Job:
    prompt: str
    max_new_tokens: int
    ignore_eos: bool

    def params(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": 0.0, "ignore_eos": self.ignore_eos}


@dataclass(frozen=True)
class Level:
    workload: str  # copy | free
    concurrency: int
    jobs: list[Job]
    warm: list[Job]


@dataclass
class Run:
    wall: float
    tokens: int
    outputs: list[list[int]]  # output ids, by job index
    stats: dict               # deltas of the engine's stats counters over the run
    foreign: float            # cores used by other processes meanwhile


@dataclass
class Cell:
    runs: list[Run] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return sum(r.tokens for r in self.runs) / sum(r.wall for r in self.runs)

    def total(self, key: str) -> float:
        return sum(r.stats.get(key, 0) for r in self.runs)


# ---- prompts from the standard library's docstrings ----
def docstrings(seed: int):
    """Docstrings (cleaned) of stdlib modules, classes and functions, file order seeded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    random.Random(seed).shuffle(files)
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and doc.isascii():
                    yield doc


def passages(tokenize, count: int, lo: int, hi: int, seed: int) -> list[str]:
    """`count` distinct docstring passages (consecutive paragraphs) of lo..hi tokens."""
    out, seen = [], set()
    for doc in docstrings(seed):
        paras = [p.strip() for p in re.split(r"\n\s*\n", doc) if p.strip()]
        for start in range(len(paras)):
            text = ""
            for p in paras[start:]:
                text = f"{text}\n\n{p}" if text else p
                if len(tokenize(text)) >= lo:
                    break
            n = len(tokenize(text))
            if lo <= n <= hi and text not in seen:
                seen.add(text)
                out.append(text)
                break  # one passage per docstring
        if len(out) == count:
            return out
    raise SystemExit(f"found only {len(out)} of {count} docstring passages of {lo}-{hi} tokens")


def first_sentences(count: int, seed: int) -> list[str]:
    """`count` distinct first sentences (5-40 words) of docstrings."""
    out, seen = [], set()
    for doc in docstrings(seed + 1):
        para = " ".join(re.split(r"\n\s*\n", doc)[0].split())
        sentence = re.split(r"(?<=[.!?])\s", para, maxsplit=1)[0]
        if 5 <= len(sentence.split()) <= 40 and sentence not in seen:
            seen.add(sentence)
            out.append(sentence)
            if len(out) == count:
                return out
    raise SystemExit(f"found only {len(out)} of {count} docstring first sentences")


def build_levels(tokenize, args) -> list[Level]:
    copy_n = sum(args.copy_requests) + sum(args.copy_concurrency)  # measured + one warm-up wave
    texts = passages(tokenize, copy_n, round(1.25 * args.copy_len), 3 * args.copy_len, args.seed)
    free_n = sum(args.free_requests) + sum(args.free_concurrency)
    sentences = first_sentences(free_n, args.seed)
    rng = random.Random(args.seed)
    levels, t, s = [], 0, 0
    for c, n in zip(args.copy_concurrency, args.copy_requests):
        jobs = [Job(COPY_TEMPLATES[(t + i) % len(COPY_TEMPLATES)].format(text=texts[t + i]), args.copy_len, False)
                for i in range(n + c)]
        t += n + c
        levels.append(Level("copy", c, jobs[:n], [Job(j.prompt, 16, False) for j in jobs[n:]]))
    lo, hi = args.free_len
    for c, n in zip(args.free_concurrency, args.free_requests):
        jobs = [Job(sentences[s + i], rng.randint(lo, hi), True) for i in range(n)]
        warm = [Job(sentences[s + n + i], 8, True) for i in range(c)]
        s += n + c
        levels.append(Level("free", c, jobs, warm))
    return levels


# ---- driving an engine ----
SPEC_KEYS = ("spec_proposed", "spec_accepted", "spec_steps", "steps", "generated_tokens")


def counters(engine) -> dict:
    stats = engine.stats()
    return {k: stats.get(k, 0) for k in SPEC_KEYS}


def flush(engine) -> None:
    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused: the engine still has running requests")


def closed_loop(engine, concurrency: int, jobs: list[Job]) -> Run:
    """Keeps `concurrency` of `jobs` in flight, submitting the next as one finishes."""
    queue, active, outputs = list(enumerate(jobs)), {}, [None] * len(jobs)
    before = counters(engine)
    with CpuAudit() as audit:
        start = time.perf_counter()
        while queue or active:
            while queue and len(active) < concurrency:
                i, job = queue.pop(0)
                (req,) = engine.submit(job.prompt, job.params())
                active[req] = i
            if not engine.step():
                engine.wait_for_work()
            for req in [r for r in active if r.finished]:
                if req.error:
                    raise RuntimeError(f"request failed: {req.error}")
                outputs[active.pop(req)] = list(req.output_ids)
        wall = time.perf_counter() - start
    after = counters(engine)
    engine.check_pool_whole()
    return Run(wall, sum(len(o) for o in outputs), outputs, {k: after[k] - before[k] for k in SPEC_KEYS},
               audit.foreign_cores)


def measure(engines: dict, levels: list[Level], rounds: int) -> dict[tuple[str, int, str], Cell]:
    """Every level: --rounds runs per side, alternating sides, both caches flushed before each."""
    cells = {(lv.workload, lv.concurrency, side): Cell() for lv in levels for side in engines}
    sides = list(engines)
    for k, lv in enumerate(levels):
        for r in range(rounds):
            for side in (sides if (k + r) % 2 == 0 else sides[::-1]):
                for e in engines.values():
                    flush(e)
                run = closed_loop(engines[side], lv.concurrency, lv.jobs)
                cells[lv.workload, lv.concurrency, side].runs.append(run)
                expected = sum(j.max_new_tokens for j in lv.jobs if j.ignore_eos)
                if lv.workload == "free" and run.tokens != expected:
                    print(f"warning: {side} {lv.workload} c={lv.concurrency}: {run.tokens} tokens, expected "
                          f"{expected} (ignore_eos not honoured?)", file=sys.stderr)
                print(f"  {lv.workload} c={lv.concurrency} round {r + 1} {side}: {run.tokens} tokens in "
                      f"{run.wall:.2f}s = {run.tokens / run.wall:.1f} tok/s (foreign {run.foreign:.2f} cores)",
                      file=sys.stderr)
    return cells


# ---- report ----
def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def spec_figures(cell: Cell) -> tuple[float | None, float | None, float]:
    proposed, accepted, spec_steps = (cell.total(k) for k in ("spec_proposed", "spec_accepted", "spec_steps"))
    steps = cell.total("steps")
    return (accepted / proposed if proposed else None, accepted / spec_steps if spec_steps else None,
            cell.total("generated_tokens") / steps if steps else float("nan"))


HEADERS = ["workload", "conc", "side", "spec", "reqs", "tokens", "wall_s", "tok/s", "on/off", "per_round", "drafts",
           "accept", "mean_acc", "tok/step", "foreign"]


def rows(levels: list[Level], cells: dict, on: str) -> list[list[object]]:
    out = []
    for lv in levels:
        off_cell, on_cell = cells[lv.workload, lv.concurrency, "off"], cells[lv.workload, lv.concurrency, "on"]
        for side, cell in (("off", off_cell), ("on", on_cell)):
            acc, mean_acc, per_step = spec_figures(cell)
            ratio = per_round = "-"
            if side == "on":
                ratio = fmt(on_cell.tok_s / off_cell.tok_s)
                per_round = ",".join(fmt(a.tokens / a.wall / (b.tokens / b.wall))
                                     for a, b in zip(on_cell.runs, off_cell.runs))
            wall = sum(r.wall for r in cell.runs)
            drafts = int(cell.total("spec_proposed")) if side == "on" else "-"
            out.append([lv.workload, lv.concurrency, side, on if side == "on" else "none",
                        len(lv.jobs) * len(cell.runs), sum(r.tokens for r in cell.runs), fmt(wall),
                        fmt(cell.tok_s, 1), ratio, per_round, drafts, fmt(acc), fmt(mean_acc), fmt(per_step),
                        fmt(max(r.foreign for r in cell.runs))])
    return out


def compare(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[str]]:
    """How many outputs are identical, and where the others first differ."""
    same, notes = 0, []
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            same += 1
            continue
        k = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        notes.append(f"#{i} at token {k} (of {len(x)}/{len(y)})")
    return same, notes


def correctness(levels: list[Level], cells: dict) -> tuple[list[str], bool]:
    lines, ok = [], True
    for lv in levels:
        key = lv.workload, lv.concurrency
        on, off = cells[(*key, "on")].runs, cells[(*key, "off")].runs
        n, same, notes = 0, 0, []
        for r, (a, b) in enumerate(zip(on, off)):
            s, ns = compare(a.outputs, b.outputs)
            n, same = n + len(a.outputs), same + s
            notes += [f"round {r + 1} {x}" for x in ns]
        ok &= same == n
        floor = ""
        if len(off) > 1:
            pairs = [(side, compare(runs[0].outputs, runs[i].outputs)[0], len(runs[0].outputs))
                     for side, runs in (("off", off), ("on", on)) for i in range(1, len(runs))]
            floor = "; across rounds: " + ", ".join(f"{side} {s}/{m}" for side, s, m in pairs)
        lines.append(f"  {lv.workload} c={lv.concurrency}: on == off {same}/{n}"
                     + (f" (differ: {'; '.join(notes[:4])}{' ...' if len(notes) > 4 else ''})" if notes else "")
                     + floor)
    return lines, ok


def verdicts(levels: list[Level], cells: dict) -> list[str]:
    def ratio(lv):
        return cells[lv.workload, lv.concurrency, "on"].tok_s / cells[lv.workload, lv.concurrency, "off"].tok_s
    disturbed = [f"{lv.workload} c={lv.concurrency}" for lv in levels
                 if max(r.foreign for s in ("on", "off") for r in cells[lv.workload, lv.concurrency, s].runs)
                 > DISTURBED_CORES]
    lines = [f"warning: other processes used > {DISTURBED_CORES} cores during some runs of "
             f"{', '.join(disturbed)}; their ratios are unreliable (see `foreign`)"] if disturbed else []
    copy1 = [lv for lv in levels if lv.workload == "copy" and lv.concurrency == 1]
    for lv in copy1:
        r = ratio(lv)
        lines.append(f"copy, concurrency 1: on / off decode tok/s = {r:.2f} "
                     f"(acceptance >= {COPY_ACCEPT:.2f}: {'ok' if r >= COPY_ACCEPT else 'BELOW'})")
    free = [lv for lv in levels if lv.workload == "free"]
    if free:
        rs = [ratio(lv) for lv in free]
        per = ", ".join(f"c={lv.concurrency} {r:.2f}" for lv, r in zip(free, rs))
        lines.append(f"free generation: on / off tok/s = {per} (acceptance >= {FREE_ACCEPT:.2f} at every "
                     f"concurrency: {'ok' if min(rs) >= FREE_ACCEPT else 'BELOW'})")
    return lines


# ---- main ----
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--speculative", default="ngram",
                    help="the `on` engine's speculative setting: ngram or draft:<path> (the `off` engine: none)")
    ap.add_argument("--rounds", type=int, default=None, help="runs per side and level (default 2; --quick: 1)")
    ap.add_argument("--quick", action="store_true",
                    help="1 round; copy 3 / 4 requests, free 3 / 16 / 64 requests of 8-64 tokens")
    ap.add_argument("--copy-concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--copy-requests", type=int, nargs="+", default=None,
                    help="requests per copy level, one per --copy-concurrency (default 5 8)")
    ap.add_argument("--copy-len", type=int, default=128, help="most new tokens of a copy request")
    ap.add_argument("--free-concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--free-requests", type=int, nargs="+", default=None,
                    help="requests per free level, one per --free-concurrency (default 6 32 64)")
    ap.add_argument("--free-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                    help="free generation output lengths, uniform (default 8 128; --quick: 8 64)")
    ap.add_argument("--seed", type=int, default=0)
    add_dataclass_args(ap, EngineConfig, skip=("speculative",), shown_defaults={"kv_pool_tokens": KV_POOL_TOKENS})
    args = ap.parse_args(argv)
    quick = {"rounds": (1, 2), "copy_requests": ([3, 4], [5, 8]), "free_requests": ([3, 16, 64], [6, 32, 64]),
             "free_len": ([8, 64], [8, 128])}
    for name, (short, full) in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, short if args.quick else full)
    if len(args.copy_requests) != len(args.copy_concurrency) or len(args.free_requests) != len(args.free_concurrency):
        ap.error("give one --copy-requests / --free-requests count per concurrency level")
    if min(args.rounds, args.copy_len, *args.copy_concurrency, *args.copy_requests, *args.free_concurrency,
           *args.free_requests, *args.free_len) < 1 or args.free_len[0] > args.free_len[1]:
        ap.error("rounds, lengths, concurrencies and request counts must be >= 1, and MIN <= MAX")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # the decode compile off unless asked for: under `auto` it starts after 128 forwards, inside a
    # measured run, on one engine and not the other (and a compiled plain decode is no verify step)
    config = {"kv_pool_tokens": KV_POOL_TOKENS, "compile_decode": "off",
              **collect(args, EngineConfig, skip=("speculative",))}
    from stemma.engine.engine import Engine
    has_field = "speculative" in {f.name for f in fields(EngineConfig)}
    t0 = time.perf_counter()
    engines = {"off": Engine(**config, **({"speculative": "none"} if has_field else {})),
               "on": Engine(**config, **({"speculative": args.speculative} if has_field else {}))}
    if not has_field:
        print("warning: EngineConfig has no `speculative` field; both engines run without speculation",
              file=sys.stderr)
    print(f"engines loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    tokenize = engines["off"].tokenize
    t0 = time.perf_counter()
    levels = build_levels(tokenize, args)
    print(f"workloads built in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    t0 = time.perf_counter()
    for lv in levels:  # warm-up: every level's concurrency once, on prompts never measured
        for e in engines.values():
            closed_loop(e, lv.concurrency, lv.warm)
    print(f"warm-up in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    t0 = time.perf_counter()
    cells = measure(engines, levels, args.rounds)
    elapsed = time.perf_counter() - t0

    copy_p, free_p = ([len(tokenize(j.prompt)) for lv in levels if lv.workload == w for j in lv.jobs] or [0]
                      for w in ("copy", "free"))
    on = args.speculative if has_field else "none(!)"
    max_tokens = getattr(engines["on"].config, "speculative_max_tokens", "-")
    print(f"\nmodel: {config.get('model') or 'default (Gemma 3 270M Q4_K_M)'}; on = {on} "
          f"(speculative_max_tokens {max_tokens}), off = none; greedy; {args.rounds} round(s) per side and level, "
          f"alternating, caches flushed before each; measured in {elapsed:.0f}s")
    print(f"copy: prompts {min(copy_p)}-{max(copy_p)} tokens, <= {args.copy_len} new tokens, EOS honoured; "
          f"free: prompts {min(free_p)}-{max(free_p)} tokens, {args.free_len[0]}-{args.free_len[1]} new tokens "
          f"(uniform, ignore_eos)")
    print("reqs, tokens, wall_s, drafts: summed over rounds; tok/s = generated tokens / wall; drafts = draft "
          "tokens proposed (verified); accept = accepted / proposed drafts; mean_acc = accepted drafts "
          "per speculating request-step; tok/step = tokens / engine step; foreign = max cores used by others")
    print(table(HEADERS, rows(levels, cells, on)))
    lines, ok = correctness(levels, cells)
    print(f"greedy output ids, on vs off, request by request: {'identical' if ok else 'DIFFER'}")
    for line in lines:
        print(line)
    for line in verdicts(levels, cells):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
