"""Load time and decode-step time of the default model: stemma vs Hugging Face transformers.

Both run in this process, on the same GGUF file, in the same dtype. transformers loads the file
through its own GGUF path; stemma through its loader (warm cache). A decode step is timed in
steady state: B requests of a 128-token random prompt, each step generating one token per
request. For stemma that is a whole engine step (schedule, forward, sample); for transformers a
forward with its KV cache plus argmax.

    python benchmarks/forward.py [--batches 1 16 64] [--steps 8] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, timed  # noqa: E402

PROMPT_LEN = 128


def stemma_decode_step(engine, batch: int, steps: int) -> float:
    from stemma import SamplingParams
    g = torch.Generator().manual_seed(batch)
    # as many new tokens as the timed and warm-up steps need: the engine keeps KV in reserve for
    # every running request's remaining tokens, so a larger limit would not admit the whole batch
    params = SamplingParams(temperature=0, max_new_tokens=steps + 8, ignore_eos=True)
    reqs = [r for _ in range(batch)
            for r in engine.submit(torch.randint(10, 20000, (PROMPT_LEN,), generator=g).tolist(), params)]
    while not all(r.is_decoding for r in reqs):
        engine.step()
    t = timed(engine.step, steps)
    for r in reqs:
        engine.abort(r.rid)
    return t


def hf_decode_step(model, batch: int, steps: int) -> float:
    """transformers' decode step at `batch`. Its prefill of a wide batch is slow on a CPU (64 x 128
    tokens did not finish in 15 minutes), so a batch over 8 prefills 8 prompts and repeats each
    cached row: the decode step that is timed is the same as after a full prefill."""
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(batch)
    repeat = batch // 8 if batch > 8 and batch % 8 == 0 else 1
    ids = torch.randint(10, 20000, (batch // repeat, PROMPT_LEN), generator=g)
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        if repeat > 1:
            cache.batch_repeat_interleave(repeat)
            nxt = nxt.repeat_interleave(repeat, dim=0)
        state = {"next": nxt}

        def step():
            o = model(state["next"], past_key_values=cache, use_cache=True, logits_to_keep=1)
            state["next"] = o.logits[:, -1].argmax(-1, keepdim=True)
        return timed(step, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                    help="stemma's weights (transformers' are dense in --dtype)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(os.cpu_count() or 1)

    import stemma
    from stemma.loader.gguf.loader import default_model_path
    # fills the loader's disk cache and the dispatch table if cold
    stemma.Engine(dtype=args.dtype, quantization=args.quantization, kv_pool_tokens=1024)
    t0 = time.perf_counter()
    engine = stemma.Engine(dtype=args.dtype, quantization=args.quantization,
                           kv_pool_tokens=max(args.batches) * (PROMPT_LEN + args.steps + 64),
                           max_running_requests=max(args.batches))
    stemma_load = time.perf_counter() - t0

    from transformers import AutoModelForCausalLM
    path = Path(default_model_path())
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    hf_load = time.perf_counter() - t0

    rows = [["load (s)", hf_load, stemma_load, hf_load / stemma_load]]
    print(f"  load: transformers {hf_load:.1f} s, stemma {stemma_load:.1f} s", flush=True)
    for b in args.batches:
        ours = stemma_decode_step(engine, b, args.steps)
        theirs = hf_decode_step(hf, b, args.steps)
        rows.append([f"decode step, batch {b} (ms)", theirs * 1e3, ours * 1e3, theirs / ours])
        print(f"  batch {b}: transformers {theirs * 1e3:.1f} ms, stemma {ours * 1e3:.1f} ms", flush=True)
    print(f"default model {path.name}, dtype {args.dtype}, stemma quantization {args.quantization} "
          f"({'/'.join(sorted(set(engine.loaded.stores.values())))} matrices), {torch.get_num_threads()} threads, "
          f"prompt {PROMPT_LEN} tokens, median of {args.steps} steps")
    print(table(["what", "transformers", "stemma", "speed-up (x)"], rows))


if __name__ == "__main__":
    main()
