"""`stemma.Engine`: the in-process engine, for offline batches, tests and the engine process."""
from __future__ import annotations

import json
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from stemma.cache.radix_cache import RadixCache
from stemma.constrained.constrainer import Constrainer
from stemma.engine.limits import Limits
from stemma.engine.output import request_output
from stemma.engine.programs import Programs
from stemma.engine.request import Request, RequestFailed
from stemma.engine.scheduler import Scheduler
from stemma.engine.stop import StopRule
from stemma.engine_config import EngineConfig
from stemma.engine.step_cost import StepCost, StepShape
from stemma.engine.warmup import warm_up
from stemma.executor import tuning
from stemma.executor.executor import Executor, fault_text
from stemma.executor.runner import ModelRunner, RunnerConfig
from stemma.executor.tensor_parallel import Workers
from stemma.loader.model import LoadedModel, load_model
from stemma.outputs import RequestOutput
from stemma.program_call import ProgramCall
from stemma.sampling.sampler import Sampler
from stemma.sampling.seeded_noise import sibling_seed
from stemma.sampling_params import ParamError, SamplingParams
from stemma.speculative.speculation import make_speculation
from stemma.text.detokenizer import TextStream
from stemma.text.publisher import Publisher

Prompt = str | Sequence[int]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this torch ({torch.__version__}) has no CUDA, or no GPU "
                         "is visible; use device cpu (or auto)")
    return device


def eos_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """EOS ids of the config, the tokenizer, and generation_config.json when the folder has one."""
    values = [getattr(loaded.config, "eos_token_id", None), getattr(loaded.tokenizer, "eos_token_id", None)]
    gen = Path(loaded.source) / "generation_config.json"
    if gen.is_file():
        values.append(json.loads(gen.read_text()).get("eos_token_id"))
    ids: set[int] = set()
    for value in values:
        ids.update([value] if isinstance(value, int) else (value or []))
    return tuple(sorted(ids))


def as_params(params: SamplingParams | dict | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams or a dict, got {type(params).__name__}")
    return params


def start_workers(cfg: EngineConfig, device: torch.device, runner: dict[str, Any]) -> Workers:
    """Ranks 1..tp-1 of a tensor-parallel engine, loading the same model with the same options."""
    dtype = cfg.dtype if isinstance(cfg.dtype, str) else str(cfg.dtype).removeprefix("torch.")
    return Workers(cfg.tp, device, {"path": cfg.model, "dtype": dtype, "quantization": cfg.quantization,
                                    "int4_group_size": cfg.int4_group_size}, runner)


def is_single(prompts: object) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, Sequence) and len(prompts) > 0
                                        and all(isinstance(t, int) for t in prompts))


class Engine:
    """Continuous-batching generation over a radix-cached KV pool, in this process.

    `Engine(model=None, **config)`: `model` is a GGUF file or Hugging Face folder (None: the default
    Gemma 3 270M); `config` takes the fields of `EngineConfig`.

    One step is three calls: `plan = scheduler.schedule()` (what runs; slots allocated),
    `out = executor.run(plan)` (forward and sampling), `scheduler.postprocess(plan, out)` (books
    tokens, stops and finishes). The engine owns the model runner, the sampler and the forward.
    """

    def __init__(self, model: str | None = None, **config: Any):
        self.config = cfg = EngineConfig.from_kwargs(model=model, **config)
        device = resolve_device(cfg.device)
        runner_config = dict(kv_pool_tokens=cfg.kv_pool_tokens, max_running_requests=cfg.max_running_requests,
                             max_context=cfg.max_context, attention_backend=cfg.attention_backend)
        self.tp_workers = start_workers(cfg, device, runner_config) if cfg.tp > 1 else None
        try:
            self.loaded = load_model(cfg.model, cfg.dtype, device, cfg.quantization, cfg.int4_group_size,
                                     tp=self.tp_workers.tp if self.tp_workers else None)
            if self.tp_workers is not None:
                self.tp_workers.join()
        except BaseException:
            if self.tp_workers is not None:
                self.tp_workers.close()
            raise
        self.dispatch = tuning.tune(self.loaded.model)
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(self.loaded, RunnerConfig(
            **runner_config, compile_decode="off" if cfg.tp > 1 else cfg.compile_decode),
            workers=self.tp_workers)
        if self.tp_workers is not None:  # the workers stop with this engine
            weakref.finalize(self, self.tp_workers.close)
        self.eos_token_ids = eos_ids(self.loaded)
        # the engine's own generator, never torch's global one: a torch.compile (the background
        # decode compile, or any in this process) saves the global RNG state when it starts and
        # restores it when it ends, which would replay the noise of every step sampled meanwhile
        generator = torch.Generator(device=self.runner.device)
        if cfg.random_seed is not None:
            generator.manual_seed(cfg.random_seed)
        else:
            generator.seed()  # from the OS's entropy
        self.sampler = Sampler(generator)
        self.constrainer = Constrainer(self.tokenizer, self.loaded.spec.vocab_size, self.eos_token_ids,
                                       cfg.enable_jump_forward, cfg.constraint_cache_size)
        self.programs = Programs.of(cfg)
        self.cache = RadixCache(self.runner.pool.allocator, self.runner.req_to_slot, cfg.enable_radix_cache,
                                self.programs.rank(cfg))
        self.spec = make_speculation(cfg, self.cache, self.runner.req_to_slot, self.runner.max_context,
                                     target=self.runner)
        if self.spec is not None and self.runner.compiled is not None:
            self.spec.compiled_saving = self.runner.compiled.saving
        self.step_cost = StepCost()
        self.scheduler = Scheduler(cfg, self.cache, self.runner.req_to_slot, self.constrainer,
                                   StopRule(self.eos_token_ids, self.runner.max_context, self.tokenizer),
                                   self.spec, self.step_cost, self.programs)
        self.executor = Executor(self.runner, self.sampler, self.constrainer, self.eos_token_ids)
        self.limits = Limits.of(cfg, self.runner.max_context)
        if cfg.has_default_targets:
            self.warm_up_step_cost()

    def warm_up_step_cost(self) -> None:
        """Seeds the step-cost model (and the one-row decode step that default_itl_slo_steps counts in)
        with synthetic forwards of a few shapes, each run on KV slot 0, which no request holds."""
        self.scheduler.slo.one_row_s = warm_up(self.runner, self.step_cost)

    # ---- requests ----
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", "this model has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ParamError("prompt", "prompt must hold at least one token")
        vocab = self.loaded.spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ParamError("prompt", f"prompt holds token ids outside [0, {vocab}): {bad[:5]}")
        return ids

    def check_token_ids(self, params: SamplingParams) -> None:
        """The token ids a request names besides its prompt lie in the vocabulary."""
        vocab = self.loaded.spec.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ParamError(name, f"{name} holds token ids outside [0, {vocab}): {bad[:5]}")

    def submit(self, prompt: Prompt, params: SamplingParams | dict | None = None, *,
               rid: str | None = None, salt: str | None = None,
               call: ProgramCall | None = None) -> list[Request]:
        """Queues a prompt; returns its `params.n` requests. A ValueError (a bad prompt, one too
        long for the context, a request past a limit of stemma.engine.limits, a bad constraint)
        queues none of them. `call`: the program context (stemma.program_call), if any."""
        params = as_params(params)
        ids = self.tokenize(prompt)
        self.limits.check(ids, params)
        self.check_token_ids(params)
        rid = rid or uuid.uuid4().hex
        reqs = []
        for i in range(params.n):
            p = params
            if params.n > 1:
                p = params.replace(n=1, seed=None if params.seed is None else sibling_seed(params.seed, i))
            reqs.append(Request(rid=rid if params.n == 1 else f"{rid}-{i}", input_ids=ids, params=p,
                                salt=salt, call=call))
        checked = self.scheduler.check(params)  # siblings share their constraint: none or all queue
        for req in reqs:
            self.scheduler.add(req, checked)
        return reqs

    def step(self) -> list[Request]:
        """One step if there is work; returns the requests that got output or finished."""
        start = time.perf_counter()
        compiling, one_offs = self._compiling(), self.runner.one_offs()
        plan = self.scheduler.schedule()
        if not plan:
            return plan.finished
        shape = StepShape.of(plan)
        predicted = self.step_cost.predict(shape)
        try:
            out = self.executor.run(plan)
        except Exception as exc:  # not tied to one request: the step's requests fail, not the engine
            if self.tp_workers is not None:  # ... unless a rank is gone: then the engine is
                self.tp_workers.raise_if_dead()
            return self.scheduler.fail_step(plan, exc)
        touched = self.scheduler.postprocess(plan, out)
        seconds = time.perf_counter() - start
        # a step beside a background compile (its Python waits at the compile gate between a
        # step's forwards no longer than 50 ms, and its compiler processes share the cores),
        # one that compiled a graph itself (compile_decode=on), or one that held the
        # row ops' one-off trial (executor.compiled_rows), is no sample of what steps cost:
        # neither fit learns from it
        stalled = compiling or self._compiling() or self.runner.one_offs() != one_offs
        if not stalled:
            self.step_cost.observe(shape, seconds, predicted)
        counters = self.scheduler.counters
        counters.steps += 1
        counters.busy_time += seconds
        if self.spec is not None and not stalled:
            self.spec.observe(plan, seconds, self.runner.ran_compiled)
        return touched

    def _compiling(self) -> bool:
        return self.runner.compiled is not None and self.runner.compiled.compiling

    def idle_timeout(self) -> float:
        """How long `wait_for_work` may wait after a step that ran nothing (Scheduler.idle_timeout)."""
        return self.scheduler.idle_timeout()

    def wait_for_work(self, timeout: float | None = None) -> None:
        """After a step that ran nothing: blocks until something may run, or `timeout` seconds
        (default: idle_timeout(), computed now) pass. With a timeout given it reads no engine
        state, so it may run on another thread (the frontend's backend does)."""
        self.scheduler.wait(self.idle_timeout() if timeout is None else timeout)

    def abort(self, rid: str) -> Request | None:
        return self.scheduler.abort(rid)

    def end_program(self, program_id: str) -> None:
        """Program `program_id` calls no more: a program-aware cache evicts its KV first."""
        self.programs.end(program_id)

    def run_until_done(self, reqs: Sequence[Request]) -> None:
        while not all(r.finished for r in reqs):
            if not self.step():
                self.wait_for_work()  # a batch window is open, or a guide is being built

    # ---- the public API ----
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | dict | Sequence[SamplingParams] | None = None):
        """One output for a single prompt (text or token ids), else a list, `n` per prompt."""
        single = is_single(prompts)
        plist = [prompts] if single else list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(plist):
                raise ValueError(f"params has {len(params)} entries for {len(plist)} prompts")
            per_prompt = [as_params(p) for p in params]
        else:
            per_prompt = [as_params(params)] * len(plist)
        reqs = [r for p, sp in zip(plist, per_prompt) for r in self.submit(p, sp)]
        self.run_until_done(reqs)
        outs = [self.output(r) for r in reqs]
        return outs[0] if single and len(outs) == 1 else outs

    def stream(self, prompt: Prompt, params: SamplingParams | dict | None = None) -> Iterator[str]:
        """Yields text deltas of one request as they are generated. A request that ends with an
        error (a fault while serving it, its detokenizer's included, or a constraint that failed
        to build) raises RequestFailed after the text it had; the engine goes on."""
        params = as_params(params)
        if params.n != 1:
            raise ValueError(f"n must be 1 when streaming, got {params.n}")
        (req,) = self.submit(prompt, params)
        publisher = Publisher(self.text_stream(req))
        try:
            while not req.finished:
                if not self.step():
                    self.wait_for_work()
                delta = self._detokenized(req, publisher.push, req.output_ids)
                if delta:
                    yield delta
            if req.finish_reason == "error":
                raise RequestFailed(req.rid, req.error)
            tail = self._detokenized(req, publisher.finish)
            if tail:
                yield tail
        finally:
            if not req.finished:
                self.abort(req.rid)

    def _detokenized(self, req: Request, decode, *args) -> str:
        """decode(*args): req's text; a detokenizer fault fails req alone (RequestFailed)."""
        try:
            return decode(*args)
        except Exception as exc:
            if not req.finished:
                self.scheduler.fail(req.rid, fault_text("detokenizing", exc))
            else:
                req.finish_reason, req.error, req.fault = "error", fault_text("detokenizing", exc), True
            raise RequestFailed(req.rid, req.error) from exc

    def text_stream(self, req: Request) -> TextStream:
        """A text stream of req's output, as the gateway would make it."""
        return TextStream.of(self.tokenizer, req.params, req.input_ids, self.eos_token_ids)

    def output(self, req: Request) -> RequestOutput:
        """req's RequestOutput, once finished. A detokenizer fault on its ids makes it an error
        (finish reason "error", meta["error"]) with no text; other outputs are unaffected."""
        try:
            text = self._text(req)
        except Exception as exc:
            req.finish_reason, req.error, req.fault = "error", fault_text("detokenizing", exc), True
            text = ""
        return request_output(req, text)

    def _text(self, req: Request) -> str:
        if req.stop_tracker is not None:
            req.stop_tracker.finish()
            return req.stop_tracker.text
        if self.tokenizer is None:
            return ""
        stream = self.text_stream(req)
        return stream.push(req.output_ids) + stream.finish()  # as the stream decodes it

    # ---- cache and stats ----
    def flush_cache(self) -> bool:
        """Drops every cached prefix; refuses (False) while requests run."""
        return self.scheduler.flush_cache()

    def stats(self) -> dict[str, Any]:
        c = self.scheduler.counters
        return {
            "cache_hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "generated_tokens": c.generated_tokens,
            "tokens_per_s": c.generated_tokens / c.busy_time if c.busy_time else 0.0,
            "steps": c.steps,
            "retractions": c.retractions,
            "compiled_decode": self.runner.compiled.state if self.runner.compiled is not None else "off",
            "compiled_decode_phase": self.runner.compiled.phase if self.runner.compiled is not None else "off",
            "compiled_rows": self.runner.compiled.rows.describe() if self.runner.compiled is not None else "off",
            "compiled_decode_batched": (" ".join(f"{k}:{v}" for k, v in self.runner.compiled.batched_states().items())
                                        if self.runner.compiled is not None else "off"),
            **self.scheduler.stats(),
            **self.cache.usage(),
            **(self.spec.stats() if self.spec is not None else {}),
        }

    def check_pool_whole(self) -> None:
        """Raises AssertionError unless free + tree-held + request-held slots == total."""
        self.scheduler.check_pool_whole()
