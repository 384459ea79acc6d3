"""The decode forward compiled by Inductor, one request and batched: the same logits and greedy
tokens as the eager forward (float32, tiny random llama and gemma3, packed matrices through
stemma::packed_linear), the background compile beside running steps, the trial that keeps the
faster kind, and the fallback to eager when the graph fails."""
import math
import os
import sys
import threading
import time

import pytest
import torch

import stemma
from stemma import SamplingParams
from stemma.executor import trace_guard
from stemma.executor.forward_batch import ForwardBatch
from stemma.executor.compiled_decode import (COMPILE_NICE, COMPILE_SWITCH_INTERVAL, ONE, START_AFTER,
                                             CompiledDecode, Trial, _ShortSwitch, resolve_mode, row_cuts)
from stemma.models.linear import KernelChoice
from stemma.models.weights import packing_available
from tests.tiny_models import build_tiny

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3], list(range(3, 40)), [7] * 12 + [20, 21, 22], [60, 2, 33, 41, 8, 8, 9]]
LONG = [3 + (7 * i) % 90 for i in range(4200)]  # decodes past 4,096 keys


# a test about threads, not the model, runs on gemma3 only with -m slow (19 s of the suite)
LLAMA_BY_DEFAULT = pytest.mark.parametrize(
    "folder", ["llama", pytest.param("gemma3", marks=pytest.mark.slow)], indirect=True)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def folder(request, tmp_path_factory):
    return str(build_tiny(request.param, tmp_path_factory.mktemp(f"{request.param}_compiled")))


def make(folder, **kw):
    return stemma.Engine(folder, **{**dict(dtype="float32", kv_pool_tokens=1024, max_running_requests=8,
                                           attention_backend="torch", speculative="none"), **kw})


def force_packed(engine):
    """Every layer matrix on oneDNN's packed kernel (the tests' tiny models are not tuned), so the
    graph runs stemma::packed_linear."""
    for name, matrix in engine.loaded.model.matrices().items():
        if name.startswith("model.layers.") and packing_available(matrix.weights().weight):
            matrix.set_kernels(KernelChoice.single("packed"))


@pytest.fixture(scope="module")
def reference(folder):
    engine = make(folder, compile_decode="off")
    force_packed(engine)
    out = [engine.generate(p, GREEDY).token_ids for p in PROMPTS]
    assert engine.runner.compiled is None
    return out


def assert_logits_match(engine, compiled, prompts, bucket):
    """The next position's logits of `prompts` decoding together, compiled (in `bucket`) and eager."""
    reqs = [engine.submit(p, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))[0]
            for p in prompts]
    while any(len(r.output_ids) < 2 for r in reqs):
        engine.step()
    runner = engine.runner
    fb = runner.prepare([[r.output_ids[-1]] for r in reqs], [r.row for r in reqs], [r.kv_len for r in reqs])
    assert compiled.bucket(fb) == bucket and compiled.wants(fb)
    with torch.inference_mode():
        got = compiled.forward(fb)
        runner.compiled = None
        want = runner.forward(fb)
    # the graph's attention divides by the softmax's denominator after its matmul (attend), eager
    # before: float32 rounding that these models' layers amplify (activations reach ~70) put up
    # to 2.2e-5 between them on logits of magnitude 8 (1.1e-5 before attend); a stale weight is
    # off by far more
    torch.testing.assert_close(got.float(), want.float(), atol=4e-5, rtol=1e-5)
    runner.pool.allocator.free(fb.out_slots)
    runner.compiled = compiled
    for r in reqs:
        engine.abort(r.rid)


def test_compiled_forward_matches_eager(folder, reference):
    engine = make(folder, compile_decode="off")
    force_packed(engine)
    compiled = engine.runner.compiled = CompiledDecode(engine.loaded.model, engine.runner.pool, "on")
    assert compiled.state == "kept"
    # one request at a time: every decode step is a one-row forward, which the graph serves
    assert [engine.generate(p, GREEDY).token_ids for p in PROMPTS] == reference
    assert compiled.calls >= len(PROMPTS) * (GREEDY.max_new_tokens - 1)
    # the logits themselves, compiled and eager, on one request's next position
    assert_logits_match(engine, compiled, PROMPTS[1:2], ONE)
    # batches of several requests decoding run the graph of their bucket (compiled in the step
    # that first meets it, under `on`), and give the same tokens
    calls = compiled.calls
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert compiled.calls - calls >= GREEDY.max_new_tokens - 1
    assert compiled.cuts == (1,) and compiled.batched_states() == {"2+": "kept"}
    # its logits against eager, three requests at different lengths
    assert_logits_match(engine, compiled, PROMPTS[:3], 1)
    runner = engine.runner
    # a forward with a prefill in it runs eager
    mixed = runner.prepare([[1], [2, 3, 4]], [0, 1], [5, 0])
    assert compiled.bucket(mixed) is None and not compiled.wants(mixed)
    runner.pool.allocator.free(mixed.out_slots)
    engine.check_pool_whole()


def test_a_context_past_4096_runs_the_graph_compiled_at_a_short_one(tmp_path):
    # Inductor's float32 sum over the keys guards on their number passing 4,096: a softmax in the
    # graph made it recompile, inside a step, once a request's context passed that
    from torch._dynamo.utils import counters
    folder = str(build_tiny("gemma3", tmp_path / "gemma3", max_position_embeddings=4608))
    engine = make(folder, compile_decode="off", kv_pool_tokens=4608)
    eager = [engine.generate(p, GREEDY).token_ids for p in (PROMPTS[0], LONG)]
    compiled = engine.runner.compiled = CompiledDecode(engine.loaded.model, engine.runner.pool, "on")
    graphs = counters["stats"]["unique_graphs"]
    assert engine.generate(PROMPTS[0], GREEDY).token_ids == eager[0]
    calls = compiled.calls
    assert engine.generate(LONG, GREEDY).token_ids == eager[1]
    assert compiled.calls - calls >= GREEDY.max_new_tokens - 1
    assert counters["stats"]["unique_graphs"] == graphs
    engine.check_pool_whole()


def test_a_norm_weight_changed_in_place_reaches_the_graph(folder):
    """A norm weight changed in place, or replaced, after the graph was compiled reaches the
    next compiled forward (the graph makes its scales from the weights: RMSNorm.scale)."""
    engine = make(folder, compile_decode="off")
    force_packed(engine)
    compiled = engine.runner.compiled = CompiledDecode(engine.loaded.model, engine.runner.pool, "on")
    layer = engine.loaded.model.model.layers[1]
    assert_logits_match(engine, compiled, PROMPTS[1:2], ONE)
    with torch.no_grad():
        layer.input_layernorm.weight.mul_(1.7).add_(0.2)
        if layer.self_attn.k_norm is not None:
            layer.self_attn.k_norm.weight.add_(0.5)
    assert_logits_match(engine, compiled, PROMPTS[1:2], ONE)
    norm = layer.post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 0.5)
    assert_logits_match(engine, compiled, PROMPTS[1:2], ONE)
    engine.check_pool_whole()


def drained(compiled, seconds: float) -> None:
    """Until the background compile thread has nothing left to do (or `seconds` pass)."""
    deadline = time.monotonic() + seconds
    while compiled.thread is not None and time.monotonic() < deadline:
        time.sleep(0.05)


def pause_if_compiling(compiled):
    """A user's pause between requests: a background compile goes on only while no forward runs
    (executor.compile_gate)."""
    if compiled.compiling:
        time.sleep(0.5)


@LLAMA_BY_DEFAULT
def test_background_compile_while_steps_run(folder, reference, monkeypatch):
    monkeypatch.setenv("STEMMA_COMPILE", "1")
    engine = make(folder, compile_decode="auto")
    compiled = engine.runner.compiled
    assert compiled is not None
    outputs, deadline = [], time.monotonic() + 600
    assert compiled.state == "waiting" and engine.stats()["compiled_decode_phase"] == "counting"
    while compiled.state in ("waiting", "compiling", "trial") and time.monotonic() < deadline:
        outputs.append(engine.generate(PROMPTS[len(outputs) % len(PROMPTS)], GREEDY).token_ids)
        pause_if_compiling(compiled)
    assert compiled.state in ("kept", "dropped"), compiled.stats()
    stats = compiled.stats()
    assert stats["compiled_ms"] > 0 and stats["eager_ms"] > 0 and stats["compile_s"] > 0
    assert engine.stats()["compiled_decode"] == compiled.state
    assert compiled.decodes_seen == START_AFTER
    assert all(out == reference[i % len(PROMPTS)] for i, out in enumerate(outputs))
    # a batch's bucket is compiled in the background once a batch meets it, and has its own trial
    assert stats["batched"] == {} and engine.stats()["compiled_decode_batched"] == ""
    while compiled.bucket_state(1) not in ("kept", "dropped") and time.monotonic() < deadline:
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
        pause_if_compiling(compiled)
    assert compiled.batched_states() == {"2+": compiled.bucket_state(1)}
    assert compiled.bucket_state(1) in ("kept", "dropped") and len(compiled.trials[1].times[True]) == 8
    assert engine.stats()["compiled_decode_batched"] == f"2+:{compiled.bucket_state(1)}"
    assert engine.stats()["compiled_decode_phase"] == "idle"  # the trials ran after the compiles
    engine.check_pool_whole()


def test_a_failing_graph_falls_back_to_eager(folder, reference):
    engine = make(folder, compile_decode="on")
    compiled = engine.runner.compiled
    assert compiled.state == "kept"

    def broken(h, ctx):
        raise RuntimeError("a graph that fails")
    compiled.graph = broken
    force_packed(engine)
    assert engine.generate(PROMPTS[0], GREEDY).token_ids == reference[0]
    assert compiled.state == "failed" and engine.stats()["compiled_decode"] == "failed"


def test_a_graph_per_bucket_of_the_dispatch_table(folder):
    """The graph traces each layer matrix's kernel pick by row count, so batch sizes between the
    same two cuts of the tables share a graph, and a cut starts a new one."""
    engine = make(folder, compile_decode="off")
    layers = [m for name, m in engine.loaded.model.matrices().items() if name.startswith("model.layers.")]
    layers[0].set_kernels(KernelChoice((1, 4, 16), ("linear", "mm_t", "linear")))
    layers[1].set_kernels(KernelChoice((2, 4), ("mm_t", "linear")))
    assert row_cuts(engine.loaded.model) == (1, 2, 4, 16)
    compiled = CompiledDecode(engine.loaded.model, engine.runner.pool, "auto")
    assert compiled.state == "waiting" and compiled.batched_states() == {}

    def bucket(rows):
        return compiled.bucket(ForwardBatch.on_padding_slot(rows, 4))
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 300)] == [ONE, 1, 2, 2, 3, 3, 4, 4]
    assert [compiled.bucket_rows(b) for b in (1, 2, 3, 4)] == [(2, 2), (3, 4), (5, 16), (17, None)]
    assert compiled.bucket(ForwardBatch.on_padding_slot(2, 4, prefill=3)) is None  # a prefill: eager
    # what a kept graph saves a plain step (speculation weighs its drafts against it): its trial's
    # eager median less its compiled one; nothing where no graph is kept
    compiled.started = True
    compiled.compiles[2], compiled.compiles[3], compiled.trials[2] = "ready", "failed", Trial(n=1)
    assert compiled.saving(3) == math.inf   # on trial: plain steps, so that the trial gets its forwards
    compiled.timed(ForwardBatch.on_padding_slot(3, 4), True, 0.030)
    compiled.timed(ForwardBatch.on_padding_slot(4, 4), False, 0.050)
    assert compiled.batched_states() == {"3-4": "kept", "5-16": "failed"}
    assert compiled.saving(3) == pytest.approx(0.020) and compiled.saving(5) == 0.0
    assert compiled.thread is None   # nothing met was left to compile


def test_trial_keeps_the_faster_kind():
    trial = Trial(n=3)
    order = []
    for compiled_s, eager_s in [(0.02, 0.03), (0.05, 0.03), (0.021, 0.031)]:
        for _ in range(2):
            kind = trial.compiled_next()
            order.append(kind)
            trial.record(kind, compiled_s if kind else eager_s)
        assert trial.verdict() is None or len(order) == 6
    assert order == [True, False] * 3       # alternating, compiled first
    assert trial.verdict() is True           # medians 21 ms against 30 ms
    slow = Trial(n=1)
    slow.record(True, 0.05)
    slow.record(False, 0.04)
    assert slow.verdict() is False


def test_where_it_applies(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mode("on", cpu, "auto") == "on"
    assert resolve_mode("on", cpu, "triton") == "off"   # the graph is the torch backend's
    assert resolve_mode("auto", cuda, "auto") == "off"
    monkeypatch.setenv("STEMMA_COMPILE", "0")
    assert resolve_mode("auto", cpu, "auto") == "off"
    assert resolve_mode("on", cpu, "torch") == "on"     # the variable steers auto only
    monkeypatch.setenv("STEMMA_COMPILE", "1")
    assert resolve_mode("auto", cpu, "torch") == "auto"
    with pytest.raises(ValueError, match="compile_decode"):
        stemma.EngineConfig(compile_decode="always")


def test_each_decode_forward_counts_once_toward_the_start(folder, monkeypatch):
    """auto starts after START_AFTER forwards in which every request decodes or verifies: each
    such forward counts once, speculation's question of what a graph would save counts none,
    and prefills count none."""
    monkeypatch.setenv("STEMMA_COMPILE", "1")
    engine = stemma.Engine(folder, dtype="float32", kv_pool_tokens=1024, max_running_requests=8,
                           attention_backend="torch", speculative="ngram", compile_decode="auto")
    compiled, runner = engine.runner.compiled, engine.runner
    seen = {"prefill": 0, "decode": 0, "verify": 0}
    forward = runner.forward

    def counting(fb):
        prefill = any(e > 1 and c == 1 for e, c in zip(fb.extend_lens_cpu, fb.logits_counts))
        seen["prefill" if prefill else "decode" if fb.num_tokens == fb.batch_size else "verify"] += 1
        return forward(fb)
    runner.forward = counting
    choose = engine.spec.choose

    def full_drafts(decodes, cands, *rest):  # asks the compiled step's saving, then drafts in full
        choose(decodes, cands, *rest)
        return [most for _, most in cands]
    engine.spec.choose = full_drafts
    loop = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    for prompt in ([7, 8, 9] * 6, [7, 8, 9] * 5 + [10, 11]):   # drafts: from their own and the first's
        engine.generate(prompt, loop)
    engine.generate(PROMPTS, GREEDY)
    assert seen["prefill"] == 3 and seen["decode"] + seen["verify"] < START_AFTER, seen
    assert seen["verify"] > 0, seen
    assert compiled.decodes_seen == seen["decode"] + seen["verify"] and compiled.state == "waiting"
    engine.check_pool_whole()


def test_eager_forwards_while_a_compile_runs_elsewhere(folder, reference):
    """While any thread compiles, torch.compiler.is_compiling() is true on every thread; an eager
    forward of an engine whose cached scales and packed weights were never made (another engine,
    or this one before its first compile) must still compute them. The context below is the one
    Dynamo enters for each compile."""
    engine = make(folder, compile_decode="off")
    force_packed(engine)
    with torch.compiler._compile_session_context():
        assert torch.compiler.is_compiling()
        assert [engine.generate(p, GREEDY).token_ids for p in PROMPTS] == reference
    engine.check_pool_whole()


def test_a_step_beside_another_threads_trace_window_runs_its_own_modules(folder, reference):
    """torch.fx's tracer, under every Inductor compile, patches nn.Module.__call__ for the whole
    process while it traces: a step beside a background compile failed ("module is not installed
    as a submodule"), and a step that waited for the window stalled for seconds. Once a compile
    job has installed the guard, a window's patches act on its own thread only: the step runs at
    once and computes what it computes alone, and the trace still records the module's call."""
    trace_guard.install()
    engine = make(folder, compile_decode="off")
    force_packed(engine)
    entered, release, traced = threading.Event(), threading.Event(), []

    class Blocker(torch.nn.Module):
        def forward(self, x):
            entered.set()
            release.wait(300)
            return torch.nn.functional.relu(x + 1)

    tracer = threading.Thread(target=lambda: traced.append(torch.fx.symbolic_trace(Blocker())))
    outputs = []
    steps = threading.Thread(target=lambda: outputs.extend(engine.generate(PROMPTS, GREEDY)))
    tracer.start()
    try:
        assert entered.wait(30)
        assert torch.nn.Module.__call__ is not stock_call  # the window's patches are in place
        steps.start()
        steps.join(120)
        assert not steps.is_alive(), "a step waited for another thread's trace window"
    finally:
        release.set()
        tracer.join(30)
        steps.join(300)
    assert [o.token_ids for o in outputs] == reference
    assert torch.nn.Module.__call__ is stock_call
    assert [n.target for n in traced[0].graph.nodes if n.op == "call_function"][-1] is torch.nn.functional.relu
    engine.check_pool_whole()


stock_call = torch.nn.Module.__call__


def test_every_bucket_compiles_on_the_background_thread(tmp_path, monkeypatch):
    """Each bucket is a recompile of one function, and the compiles run on their own thread,
    which does not see a recompile limit set in dynamo's config on another: the limit goes with
    the function. Ten buckets (over dynamo's default limit of 8), traced by dynamo's eager
    backend so that the test takes seconds."""
    eager = torch.compile

    def traced_only(fn, **kw):
        kw.pop("options", None)
        return eager(fn, backend="eager", **kw)
    monkeypatch.setattr(torch, "compile", traced_only)
    engine = make(str(build_tiny("llama", tmp_path)), compile_decode="off")
    layer = next(m for name, m in engine.loaded.model.matrices().items() if name.startswith("model.layers."))
    cuts = tuple(range(1, 10))
    layer.set_kernels(KernelChoice(cuts, ("linear", "mm_t") * 4 + ("linear",)))
    compiled = CompiledDecode(engine.loaded.model, engine.runner.pool, "auto")
    compiled.started = True
    for rows in range(1, 11):
        assert compiled.saving(rows) == 0.0   # meets the bucket: queued for the thread
    drained(compiled, 300)
    states = {b: compiled.bucket_state(b) for b in [ONE, *range(1, len(cuts) + 1)]}
    assert len(states) == 10 and set(states.values()) == {"trial"}, states


def test_the_background_compile_runs_at_the_lowest_priority_and_the_steps_do_not(tmp_path, monkeypatch):
    """The compile thread (and the compiler processes it starts) takes only the CPU the steps
    leave idle (benchmarks/compile_load.py: at the default priority a 64-request batch on 2
    cores decoded 2-10x slower for the minutes its graphs compiled)."""
    engine = make(str(build_tiny("llama", tmp_path)), compile_decode="off")
    compiled = CompiledDecode(engine.loaded.model, engine.runner.pool, "auto")
    seen = {}

    def record(bucket):
        seen[bucket] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    monkeypatch.setattr(compiled, "_compile", record)
    compiled.started = True
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert compiled.saving(1) == 0.0   # meets the one-request bucket: queued for the thread
    drained(compiled, 60)
    assert seen == {ONE: COMPILE_NICE}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # this thread's stays


def test_the_switch_interval_is_short_while_any_compile_thread_lives():
    """Two engines' compile threads overlap: the interval stays short until the last one ends,
    and then it is the one in force before the first began."""
    before, switch = sys.getswitchinterval(), _ShortSwitch()
    try:
        sys.setswitchinterval(0.002)
        switch.__enter__()           # engine A's thread
        switch.__enter__()           # engine B's, while A's lives
        switch.__exit__(None, None, None)
        assert sys.getswitchinterval() == pytest.approx(COMPILE_SWITCH_INTERVAL)
        switch.__exit__(None, None, None)
        assert sys.getswitchinterval() == pytest.approx(0.002)
        with switch:
            assert sys.getswitchinterval() == pytest.approx(COMPILE_SWITCH_INTERVAL)
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)


def test_a_compile_jobs_own_forwards_do_not_wait_for_steps():
    """A compile job's dummy forwards compile for tens of seconds: they must not hold the guard
    that steps wait on, nor wait for a step's forward."""
    inside, done, finished, seen = threading.Event(), threading.Event(), [], []

    def step():
        with trace_guard.forwarding():
            inside.set()
            done.wait(10)
            seen.append(bool(finished))  # the job's forward ran while this one held the guard

    other = threading.Thread(target=step)
    other.start()
    assert inside.wait(30)
    with trace_guard.compile_job(), trace_guard.forwarding():
        finished.append(True)
        done.set()
    other.join(30)
    assert seen == [True]
