"""Which store each weight matrix gets (dense, int8, int4), and putting the model in them.

    quantization  none: every matrix dense (in the model dtype)
                  int8: every matrix int8 (per output channel)
                  int4: every matrix int4 (per group of `int4_group_size`) where torch's CPU
                        kernel takes its shape, else int8
                  auto: a GGUF file's tensors by precision class (float types dense, Q8_0
                        AUTO_INT8, the 4-6-bit types AUTO_LOW_BIT); a Hugging Face folder is dense

A stacked matrix (q/k/v, gate/up) takes the most precise class of its parts. Matrices are
quantized from float32 weights, never from values already rounded to bf16.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stemma.models.weights import DenseWeight, Int4Weight, Int8Weight, check_int4_layout

if TYPE_CHECKING:
    from stemma.models.causal_lm import CausalLM

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
INT8_TYPES = ("Q8_0", "Q8_1", "Q8_K")
# What `auto` makes of a Q8_0 tensor and of a 4-6-bit one (Q4_K, Q5_0, Q6_K, ...): the fastest
# store that passes the quality gate on the default model (tests/quality_gate.py: >= 97% top-1
# agreement with the float32 model, perplexity within 2%). Measured with bf16 activations: dense
# 97.33%; int8 everywhere 93.54%; int8 for the 4-6-bit layers with a dense output matrix 95.07%;
# int4 (groups of 64) 60.61%. No quantized plan passes, so `auto` is dense until one does.
AUTO_INT8 = "dense"
AUTO_LOW_BIT = "dense"
_PRECISION = {"dense": 2, "int8": 1, "int4": 0}


def class_of(qtype: str) -> str:
    if qtype in FLOAT_TYPES:
        return "dense"
    if qtype in INT8_TYPES:
        return AUTO_INT8
    return AUTO_LOW_BIT


def plan(model: CausalLM, quantization: str, qtypes: dict[str, str] | None) -> dict[str, str]:
    """Module name -> store kind, for every matrix of `model` (`quantization` already checked)."""
    names = list(model.matrices())
    if quantization == "auto" and not qtypes:
        quantization = "none"
    if quantization != "auto":
        kind = "dense" if quantization == "none" else quantization
        return {name: kind for name in names}
    kinds: dict[str, str] = {}
    for hf_name, qtype in qtypes.items():
        param, _ = model._map_name(hf_name)
        if param is None or not param.endswith(".weight"):
            continue
        module = param[:-len(".weight")]
        if module in names:
            kind = class_of(qtype)
            if module not in kinds or _PRECISION[kind] > _PRECISION[kinds[module]]:
                kinds[module] = kind
    return {name: kinds.get(name, "dense") for name in names}


def store_for(kind: str, weight: torch.Tensor, dtype: torch.dtype, group_size: int,
              tied: bool, absmax: torch.Tensor | None = None) -> DenseWeight | Int8Weight | Int4Weight:
    """The store of `kind` for float32 `weight`; int4 falls back to int8 where the CPU kernel
    does not take the shape (or, for the tied embedding, where its row layout is not the known one).
    `absmax`: int8's per-row magnitudes, when `weight` is a slice of wider rows (tensor parallel)."""
    if kind == "int4" and Int4Weight.supports(weight, group_size) and (not tied or check_int4_layout()):
        return Int4Weight.quantize(weight, dtype, group_size)
    if kind in ("int4", "int8"):
        return Int8Weight.quantize(weight, dtype, absmax)
    return DenseWeight(weight.to(dtype))


def apply(model: CausalLM, kinds: dict[str, str], dtype: torch.dtype, group_size: int,
          row_absmax: dict[str, torch.Tensor] | None = None) -> dict[str, str]:
    """Puts every matrix of `model` (loaded in float32) in its store, and the rest of the model in
    `dtype`. Returns module name -> the store kind each got. `row_absmax`: module name -> the
    whole rows' magnitudes of a matrix that holds a slice of its columns (see store_for)."""
    got = {}
    tied = model.lm_head is None
    for name, matrix in model.matrices().items():
        weight = matrix.weight.detach()
        store = store_for(kinds[name], weight, dtype, group_size, tied and name == "model.embed_tokens",
                          (row_absmax or {}).get(name))
        if isinstance(store, DenseWeight):
            matrix.weight.data = store.weight
            matrix.store = None
        else:
            matrix.use_store(store)
        got[name] = store.kind
    model.to(dtype)
    return got
