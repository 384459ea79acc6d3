"""Where a single-stream decode step goes, against the floor of its own matmuls.

One request of a 128-token prompt decodes on the default model. Over `--steps` engine steps the
torch profiler splits self CPU time into matmuls (aten::mm/addmm and the int8/int4 weight-only
kernels), attention (the torch backend's KV gathers and writes, bmm, softmax, masks) and the
rest. Then, in the same run, every matrix of the model is timed alone at one row with the kernel
the dispatch table gave it: their sum is the step's matmul floor, and step / floor is the
overhead ratio.

    python benchmarks/step_profile.py [--quantization auto] [--steps 20] [--dtype auto]
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
    args = ap.parse_args()

    import stemma
    from stemma import SamplingParams
    import torch
    from torch.profiler import ProfilerActivity, profile

    # speculation off: the step measured is a plain one-row decode (a verify step has more rows)
    engine = stemma.Engine(quantization=args.quantization, dtype=args.dtype, kv_pool_tokens=4096,
                           max_running_requests=2, speculative="none")
    (req,) = engine.submit(list(range(100, 228)),
                           SamplingParams(temperature=0, max_new_tokens=3 * args.steps + 16, ignore_eos=True))
    while not req.is_decoding:
        engine.step()
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    step_ms = statistics.median(times) * 1e3

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    split = {"matmul": 0.0, "attention": 0.0, "rest": 0.0}
    for ev in prof.key_averages():
        kind = "matmul" if ev.key in MATMUL_OPS else "attention" if ev.key in ATTENTION_OPS else "rest"
        split[kind] += ev.self_cpu_time_total / 1e3 / args.steps
    engine.abort(req.rid)

    model = engine.loaded.model
    floor_ms = 0.0
    with torch.inference_mode():
        for matrix in model.matrices().values():
            store = matrix.weights()
            kernel = matrix.kernels.pick(1) if matrix.kernels else store.kernels[0]
            x = torch.randn(1, store.shape[1]).to(next(model.parameters()).dtype)
            store.matmul(x, kernel)
            n, t0 = 0, time.perf_counter()
            while n < 5 or time.perf_counter() - t0 < 0.05:
                store.matmul(x, kernel)
                n += 1
            floor_ms += (time.perf_counter() - t0) / n * 1e3

    profiled = sum(split.values())
    stores = "/".join(sorted(set(engine.loaded.stores.values())))
    print(f"default model, quantization {args.quantization} ({stores} matrices), "
          f"{next(model.parameters()).dtype}, {torch.get_num_threads()} threads; batch 1, "
          f"128-token prompt; median of {args.steps} steps")
    rows = [["decode step (ms, unprofiled)", step_ms, ""],
            ["its matmuls timed alone (ms, the floor)", floor_ms, ""],
            ["step / floor", step_ms / floor_ms, ""]]
    rows += [[f"profiled: {k} (ms per step)", v, f"{100 * v / profiled:.0f}%"] for k, v in split.items()]
    print(table(["what", "value", "share"], rows))


if __name__ == "__main__":
    main()
