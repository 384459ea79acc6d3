"""Where a single-stream decode step goes, against the floor of its own matmuls.

One request of a 128-token prompt decodes on the default model (speculation off, so each step is
a plain one-row decode; the one-row decode forward compiled or not as --compile-decode says, and
under `auto` the script waits until the engine has kept or dropped the compiled graph; then a
fresh request of another 128-token prompt is measured, since that wait decodes hundreds of tokens
and attention grows with the context). Over `--steps` engine steps the torch profiler splits self
CPU time into matmuls (aten::mm/addmm, oneDNN's packed linear and the int8/int4 weight-only
kernels), attention (the torch backend's KV gathers and writes, bmm, softmax, masks) and the
rest. In a compiled step the KV gathers, writes, masks and softmax run inside Inductor's fused
loops, which the profiler counts as the graph's own time: there they fall in the rest. Then, in
the same run, the step's matrices are timed at one row with the kernels the dispatch table gave
them, two ways:

- in sequence: every matrix once, in the order the step runs them (layer by layer, then the
  output matrix), repeated; the weights stream through the caches as they do in the step;
- each alone: every matrix timed in a loop of its own and the times summed; a layer's small
  matrices then sit in the CPU's cache, which they never do in the step.

step / floor is the overhead ratio against each. Steps and floors are measured in --rounds
alternating rounds, each figure the median of its rounds.

    python benchmarks/step_profile.py [--quantization auto] [--steps 20] [--dtype auto] [--compile-decode auto]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

MATMUL_OPS = {"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu"}
ATTENTION_OPS = {"aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::softmax", "aten::index_select",
                 "aten::index_copy_", "aten::masked_fill", "aten::masked_fill_", "aten::where"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile-decode", default="auto", choices=["auto", "on", "off"])
    args = ap.parse_args()

    import stemma
    from stemma import SamplingParams
    import torch
    from torch.profiler import ProfilerActivity, profile

    # speculation off: the step measured is a plain one-row decode (a verify step has more rows)
    engine = stemma.Engine(quantization=args.quantization, dtype=args.dtype, kv_pool_tokens=4096,
                           max_running_requests=2, speculative="none", compile_decode=args.compile_decode)

    def decoding(prompt: list[int]):
        """A request of `prompt`, stepped until it has decoded a few tokens."""
        (req,) = engine.submit(prompt, SamplingParams(temperature=0, max_new_tokens=3500, ignore_eos=True))
        while not req.is_decoding or len(req.output_ids) < 5:
            engine.step()
        return req

    compiled = engine.runner.compiled
    req = decoding(list(range(100, 228)))
    waited = time.perf_counter()
    while compiled is not None and compiled.state in ("waiting", "compiling", "trial"):
        if compiled.compiling:  # it compiles in the time the steps leave idle: none, here
            time.sleep(0.5)
        else:
            engine.step()   # auto: eager steps until the compile starts, then its trial
        if time.perf_counter() - waited > 600:
            sys.exit("the compiled decode forward was not decided within 600 s")
    assert len(req.output_ids) < 2000, "the context ran long while waiting"
    # the measured request starts afresh: the wait above decoded hundreds of tokens, and a step's
    # attention grows with its context
    engine.abort(req.rid)
    req = decoding(list(range(300, 428)))
    first_context = req.kv_len

    model = engine.loaded.model
    dtype = next(model.parameters()).dtype
    layer_mats = [m for name, m in model.matrices().items() if name.startswith("model.layers.")]
    mats = layer_mats + [model.output_matrix()]
    calls = [(m.weights(), m.kernels.pick(1) if m.kernels else m.weights().kernels[0]) for m in mats]
    xs = [torch.randn(1, store.shape[1]).to(dtype) for store, _ in calls]

    def in_sequence() -> None:
        for (store, kernel), x in zip(calls, xs):
            store.matmul(x, kernel)

    def timed(fn, n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    steps, seq, alone = [], [], []
    with torch.inference_mode():
        for _ in range(args.rounds):
            steps.append(timed(engine.step, args.steps))
            in_sequence()
            seq.append(timed(in_sequence, args.steps))
            total = 0.0
            for (store, kernel), x in zip(calls, xs):
                store.matmul(x, kernel)
                n, t0 = 0, time.perf_counter()
                while n < 5 or time.perf_counter() - t0 < 0.05:
                    store.matmul(x, kernel)
                    n += 1
                total += (time.perf_counter() - t0) / n * 1e3
            alone.append(total)
    step_ms, seq_ms, alone_ms = (statistics.median(v) for v in (steps, seq, alone))

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    split = {"matmul": 0.0, "attention": 0.0, "rest": 0.0}
    for ev in prof.key_averages():
        kind = "matmul" if ev.key in MATMUL_OPS else "attention" if ev.key in ATTENTION_OPS else "rest"
        split[kind] += ev.self_cpu_time_total / 1e3 / args.steps
    last_context = req.kv_len
    engine.abort(req.rid)

    profiled = sum(split.values())
    stores = "/".join(sorted(set(engine.loaded.stores.values())))
    state = compiled.stats() if compiled is not None else {"state": "off"}
    print(f"default model, quantization {args.quantization} ({stores} matrices), {dtype}, "
          f"{torch.get_num_threads()} threads; batch 1, 128-token prompt, context {first_context}-{last_context} "
          f"tokens over the steps measured; compiled decode: {state}; "
          f"medians of {args.rounds} rounds of {args.steps} steps")
    rows = [["decode step (ms, unprofiled)", step_ms, " ".join(f"{v:.1f}" for v in steps)],
            ["its matmuls in sequence (ms, the floor)", seq_ms, " ".join(f"{v:.1f}" for v in seq)],
            ["its matmuls each alone, summed (ms)", alone_ms, " ".join(f"{v:.1f}" for v in alone)],
            ["step / floor (in sequence)", step_ms / seq_ms, ""],
            ["step / floor (each alone)", step_ms / alone_ms, ""]]
    rows += [[f"profiled: {k} (ms per step)", v, f"{100 * v / profiled:.0f}%"] for k, v in split.items()]
    print(table(["what", "value", "per round / share"], rows))


if __name__ == "__main__":
    main()
