"""The quality gate of quantized weights: on a fixed English text of >= 4,096 tokens, each
`quantization` setting's teacher-forced top-1 agreement with the float32 unquantized model, and
its perplexity against that model's.

The text is built from the docstrings of a fixed list of standard-library modules (local, no
download; fixed for a given Python version). It is scored in windows of WINDOW tokens, each
read from scratch, so the cost is the number of tokens and not the square of the text's length.

    python -m tests.quality_gate [--settings auto none int8 int4] [--dtype auto]   prints the table
"""
from __future__ import annotations

import argparse
import importlib
import math
import time

import torch

MODULES = ("argparse", "collections", "contextlib", "functools", "inspect", "json", "logging",
           "subprocess", "typing", "unittest", "textwrap", "threading", "asyncio", "email",
           "http.server", "pathlib", "shutil", "tempfile", "zipfile", "tarfile", "pickle", "csv",
           "datetime", "decimal", "fractions", "statistics", "random", "heapq", "bisect", "queue")
MIN_TOKENS = 4096
WINDOW = 512
AGREEMENT_MIN = 0.97
PPL_MAX_RATIO = 1.02


def fixed_text() -> str:
    parts = []
    for name in MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        parts.append(doc.strip())
    return "\n\n".join(p for p in parts if p)


def token_ids(tokenizer) -> list[int]:
    ids = tokenizer(fixed_text()).input_ids
    if len(ids) < MIN_TOKENS:
        raise ValueError(f"the fixed text has {len(ids)} tokens, fewer than {MIN_TOKENS}")
    return ids


@torch.inference_mode()
def score(engine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 token, logprob of the actual next token) at every scored position."""
    runner = engine.runner
    tops, lps = [], []
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start:start + WINDOW + 1]
        row = runner.req_to_slot.alloc_row()
        fb = runner.prepare([window[:-1]], [row], [0], logit_starts=[0])
        logits = runner.forward(fb).float()
        tops.append(logits.argmax(-1))
        lps.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(window[1:])[:, None])[:, 0])
        runner.pool.allocator.free(fb.out_slots)
        runner.req_to_slot.free_row(row)
    return torch.cat(tops), torch.cat(lps)


def measure(settings=("auto", "none", "int8", "int4"), dtype: str = "auto") -> dict:
    import stemma
    reference = stemma.Engine(dtype="float32", quantization="none", kv_pool_tokens=WINDOW + 8,
                              max_running_requests=1)
    ids = token_ids(reference.tokenizer)
    ref_top, ref_lp = score(reference, ids)
    ref_ppl = math.exp(-ref_lp.mean().item())
    del reference
    rows = {"reference": {"agreement": 1.0, "ppl": ref_ppl, "ppl_ratio": 1.0, "tokens": len(ids),
                          "stores": "dense", "dtype": "float32"}}
    for setting in settings:
        t0 = time.perf_counter()
        engine = stemma.Engine(dtype=dtype, quantization=setting, kv_pool_tokens=WINDOW + 8,
                               max_running_requests=1)
        top, lp = score(engine, ids)
        ppl = math.exp(-lp.mean().item())
        rows[setting] = {"agreement": (top == ref_top).float().mean().item(), "ppl": ppl,
                         "ppl_ratio": ppl / ref_ppl, "tokens": len(ids),
                         "stores": "/".join(sorted(set(engine.loaded.stores.values()))),
                         "dtype": str(next(engine.loaded.model.parameters()).dtype).replace("torch.", ""),
                         "seconds": time.perf_counter() - t0}
        engine.check_pool_whole()
        del engine
    return rows


def passes(row: dict) -> bool:
    return row["agreement"] >= AGREEMENT_MIN and row["ppl_ratio"] <= PPL_MAX_RATIO


def table(rows: dict) -> str:
    lines = ["| setting | stores | activations | top-1 agreement | perplexity | vs fp32 | gate |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        gate = "" if name == "reference" else ("pass" if passes(r) else "FAIL")
        lines.append(f"| {name} | {r['stores']} | {r['dtype']} | {100 * r['agreement']:.2f}% | "
                     f"{r['ppl']:.3f} | {r['ppl_ratio']:.4f}x | {gate} |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", nargs="+", default=["auto", "none", "int8", "int4"])
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    results = measure(tuple(args.settings), args.dtype)
    print(f"{results['reference']['tokens']} tokens of stdlib docstrings, windows of {WINDOW}; "
          f"reference: the float32 model, unquantized")
    print(table(results))
