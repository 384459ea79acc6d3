"""The row ops (norms, q/k norm with rope, activation) compiled by Inductor for eager forwards of
many rows: the same values as the eager functions (float32), the same logits and greedy tokens
as an engine without them (tiny random llama and gemma3), no compile in a step after their
warm-up, and the trial: its rule for the row count they start at, and where it runs."""
import time

import torch
import torch.nn.functional as F

from stemma import SamplingParams
from stemma.executor.compile_gate import GATE
from stemma.executor.compiled_decode import ROWS, CompiledDecode
from stemma.executor.compiled_rows import ROWS_TRIED, CompiledRows
from stemma.executor.forward_batch import ForwardBatch
from stemma.models.row_ops import EAGER, RowOps, compiled_row_ops
from tests.test_compiled_decode import drained, folder, make  # noqa: F401 (folder: the tiny models' fixture)
from tests.tiny_models import build_tiny

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [list(range(3, 40)), [7] * 30 + list(range(20, 60)), list(range(50, 83))]  # 33-70 tokens, ids < 96


def test_compiled_ops_match_eager_on_both_layouts():
    torch.manual_seed(0)
    ops = compiled_row_ops()
    rows, hidden, heads, d = 40, 24, 3, 8
    x = torch.randn(rows, hidden)
    y_t = torch.randn(hidden, rows).t()  # a transposed view, as some matmul kernels leave it
    scale, w = torch.randn(hidden), torch.randn(hidden)
    qkv = torch.randn(rows, heads * d + 16)
    qk = qkv[:, :heads * d].reshape(rows, heads, d)
    angles = torch.randn(rows, 1, d // 2)
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((-angles.sin(), angles.sin()), -1)
    gate, up = torch.randn(2 * 17, rows).t().split(17, dim=-1)
    act = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    cases = [("norm", (x, scale, 1e-6)), ("norm", (y_t, scale, 1e-6)), ("norm_after", (x, w, 1e-5)),
             ("add_norm", (x, y_t, scale, 1e-6)), ("qk_rope", (qk, torch.randn(heads, d), 1e-6, cos, sin, torch.float32)),
             ("qk_rope", (qk, None, 0.0, cos, sin, torch.float32)), ("act_mul", (gate, up, act))]
    for name, args in cases:
        torch.testing.assert_close(getattr(ops, name)(*args), getattr(EAGER, name)(*args),
                                   atol=1e-5, rtol=1e-5, msg=name)


def test_compiled_ops_round_to_bf16_where_the_eager_ones_do():
    """Each cast back to bf16 rounds as eager (without emulate_precision_casts Inductor kept float32
    through the multiply or add after it: a quarter of these outputs differed)."""
    torch.manual_seed(1)
    ops = compiled_row_ops()
    x, y = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(64, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    scale = torch.randn(256)
    gate, up = torch.randn(64, 96, dtype=torch.bfloat16), torch.randn(64, 96, dtype=torch.bfloat16)
    act = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    for name, args in (("norm_after", (x, w, 1e-5)), ("add_norm", (x, y, scale, 1e-6)), ("act_mul", (gate, up, act))):
        got, want = getattr(ops, name)(*args), getattr(EAGER, name)(*args)
        differ = (got != want).float().mean().item()
        assert differ < 0.01, f"{name}: {differ:.1%} of the outputs differ"  # only a reduction's last bit may


def spy(ops: RowOps, calls: list[str], fail: bool = False) -> RowOps:
    """`ops`, each call recorded in `calls` by name (`fail`: each then raises instead)."""
    def wrap(name):
        def call(*args):
            calls.append(name)
            if fail:
                raise RuntimeError(f"{name} broke")
            return getattr(ops, name)(*args)
        return call
    return RowOps(**{name: wrap(name) for name in RowOps.__dataclass_fields__})


def test_engine_with_compiled_row_ops_matches_eager(folder):
    want_engine = make(folder, compile_decode="off")
    want = [want_engine.generate(p, GREEDY).token_ids for p in PROMPTS]
    engine = make(folder, compile_decode="on")
    rows = engine.runner.compiled.rows
    assert rows.state == "ready" and engine.stats()["compiled_rows"] == "ready"
    rows.state, rows.min_rows = "kept", 32  # whatever the trial would say on this machine
    calls = []
    rows.ops = spy(rows.ops, calls)
    assert engine.runner.compiled.row_ops(33) is rows.ops and engine.runner.compiled.row_ops(31) is EAGER
    # `on` compiles a decode bucket in the step that first meets it: meet the batch of three here,
    # with prefills of 5 rows (eager ops), so that the count below sees only the row ops' graphs
    engine.generate([[5 + i] * 5 for i in range(len(PROMPTS))], GREEDY)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # each prompt alone: its prefill (33-70 rows) runs the compiled ops; together (140 rows) too
    assert [engine.generate(p, GREEDY).token_ids for p in PROMPTS] == want
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == want
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the warm-up met every layout
    assert calls.count("norm") + calls.count("norm_after") > 0 and "act_mul" in calls  # the forwards ran them
    engine.check_pool_whole()
    # the logits of one prefill, compiled ops and eager
    runner = engine.runner
    with torch.inference_mode(False):
        fb = ForwardBatch.on_padding_slot(0, 0, prefill=45)
    with torch.inference_mode():
        got = runner.compiled._run_rows(fb, rows.ops)
        ref = runner.compiled._run_rows(fb, EAGER)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_trial_keeps_compiled_ops_from_the_lowest_count_of_an_unbroken_run_of_wins():
    compiled_ops = RowOps()  # not EAGER itself: the fake forward tells them apart by identity

    def fake_run(wins_from):
        def run(fb, ops):
            eager = ops is EAGER
            time.sleep(0.004 if eager else 0.002 if fb.num_tokens >= wins_from else 0.008)
        return run

    for wins_from, kept in ((128, 128), (32, 32), (10_000, None)):
        rows = CompiledRows(fake_run(wins_from), cuts=(1,))
        rows.state, rows.ops = "ready", compiled_ops
        assert rows.ops_for(512, compiling=True) is EAGER and rows.state == "ready"  # no trial beside a compile
        got = rows.ops_for(512, compiling=False)
        assert rows.min_rows == kept
        assert rows.state == ("kept" if kept else "dropped")
        assert got is (compiled_ops if kept else EAGER)
        if kept:
            assert rows.ops_for(kept - 1, compiling=False) is EAGER and rows.describe() == f"kept >= {kept} rows"


def test_the_step_that_holds_the_trial_is_no_sample_of_step_cost(folder):
    engine = make(folder, compile_decode="on")
    rows = engine.runner.compiled.rows
    assert rows.state == "ready"
    trial = rows.trial

    def slow_trial():  # the real trial, made longer than any step of this tiny model
        trial()
        time.sleep(0.5)
    rows.trial = slow_trial
    engine.generate(PROMPTS[0], GREEDY)
    assert rows.trials_run == 1 and rows.state in ("kept", "dropped")
    samples = [seconds for _, seconds in engine.step_cost.samples]
    assert samples and max(samples) < 0.5
    engine.check_pool_whole()


def test_compiled_ops_that_raise_leave_every_forward_eager(folder):
    want_engine = make(folder, compile_decode="off")
    want = [want_engine.generate(p, GREEDY).token_ids for p in PROMPTS]
    engine = make(folder, compile_decode="on")
    rows = engine.runner.compiled.rows
    calls = []
    rows.state, rows.min_rows, rows.ops = "kept", 32, spy(rows.ops, calls, fail=True)
    assert [engine.generate(p, GREEDY).token_ids for p in PROMPTS] == want  # the failed forward reran eager
    assert rows.state == "failed" and engine.runner.compiled.row_ops(512) is EAGER
    assert len(calls) == 1  # the first compiled call raised; none was called again
    engine.check_pool_whole()


def test_a_trial_that_raises_leaves_every_forward_eager():
    def run(fb, ops):
        if ops is not EAGER:
            raise RuntimeError("compiled op broke")
    rows = CompiledRows(run, cuts=(1,))
    rows.state, rows.ops = "ready", RowOps()
    for _ in range(3):
        assert rows.ops_for(512, compiling=False) is EAGER
    assert rows.state == "failed" and rows.trials_run == 1


def test_a_timing_during_which_a_forward_began_is_taken_again():
    """In `auto` the trial runs on the compile thread, whose Python a forward pauses: that
    timing would hold the pause."""
    seconds = iter([0.05, 0.001])

    def run(fb, ops):
        pause = next(seconds)
        if pause > 0.01:
            with GATE.forward():  # a step's forward began meanwhile
                pass
        time.sleep(pause)
    rows = CompiledRows(run, cuts=(1,))
    assert rows._timed(32, EAGER, paced=True) < 0.01


def test_auto_times_the_row_ops_on_the_compile_thread_not_in_a_step(tmp_path):
    engine = make(str(build_tiny("llama", tmp_path)), compile_decode="off")
    compiled = CompiledDecode(engine.loaded.model, engine.runner.pool, "auto")
    compiled.started = True
    with compiled.lock:
        compiled.rows.state = "queued"
        compiled._queue(ROWS)
    drained(compiled, 300)
    assert compiled.rows.state in ("kept", "dropped") and compiled.rows.trials_run == 1
    assert set(compiled.rows.times) == set(ROWS_TRIED)
    engine.check_pool_whole()
