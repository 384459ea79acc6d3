"""Blocking calls in program bodies (suspend.py) and stemma.tool (tool.py), on the mock backend:
a body that blocks pauses itself alone, async bodies await on the loop, tool calls leave pause
hints, and programs that do not block give the same outputs as before."""
import asyncio
import threading
import time

import pytest

import stemma
from stemma.lang.backends.mock import MockBackend
from stemma.lang.tool import tool

N, PAUSE = 32, 0.5  # 32 programs, each pausing twice: 32 s if the pauses were serialized


def _body_threads():
    return [t for t in threading.enumerate() if t.name == "stemma-body"]


@stemma.function
def plain(s, i):
    s += f"Task {i}:" + stemma.gen("a", max_new_tokens=6)
    s += " then" + stemma.gen("b", max_new_tokens=6)
    s += " ok? " + stemma.select("c", ["yes", "no"])


@stemma.function
def sleeps(s, i):
    s += f"Task {i}:" + stemma.gen("a", max_new_tokens=6)
    time.sleep(PAUSE)                       # a blocking call (an HTTP tool, a database query)
    s += " then" + stemma.gen("b", max_new_tokens=6)
    time.sleep(PAUSE)
    s += " ok? " + stemma.select("c", ["yes", "no"])


@stemma.function
async def awaits(s, i):
    s += f"Task {i}:" + stemma.gen("a", max_new_tokens=6)
    await asyncio.sleep(PAUSE)
    s += " then" + stemma.gen("b", max_new_tokens=6)
    await asyncio.sleep(PAUSE)
    s += " ok? " + stemma.select("c", ["yes", "no"])


@tool
def slow_tool(x):
    time.sleep(PAUSE)
    return x


@tool(name="lookup")
async def async_tool(x):
    await asyncio.sleep(PAUSE)
    return x


@stemma.function
def uses_tools(s, i):
    s += f"Task {i}:" + stemma.gen("a", max_new_tokens=6)
    slow_tool(s["a"])
    s += " then" + stemma.gen("b", max_new_tokens=6)
    async_tool(1)                           # an async tool, from a sync body: its result
    s += " ok? " + stemma.select("c", ["yes", "no"])


@stemma.function
async def awaits_tools(s, i):
    s += f"Task {i}:" + stemma.gen("a", max_new_tokens=6)
    slow_tool(s["a"])                       # a sync tool in an async body: off the loop
    s += " then" + stemma.gen("b", max_new_tokens=6)
    await async_tool(1)
    s += " ok? " + stemma.select("c", ["yes", "no"])


def _expected():
    return [s.text() for s in plain.run_batch([{"i": i} for i in range(N)], backend=MockBackend())]


@pytest.mark.parametrize("program", [sleeps, awaits, uses_tools, awaits_tools],
                         ids=["time.sleep", "asyncio.sleep", "tool", "tool-async-body"])
def test_pauses_overlap_under_run_batch(program):
    expected = _expected()
    before = threading.active_count()
    start = time.perf_counter()
    states = program.run_batch([{"i": i} for i in range(N)], backend=MockBackend())
    took = time.perf_counter() - start
    assert took < 2.0, f"{N} programs pausing 2 x {PAUSE} s took {took:.2f} s"
    assert [s.text() for s in states] == expected   # pauses change nothing but the time
    assert threading.active_count() == before and not _body_threads()  # none left behind


def test_plain_bodies_give_the_same_outputs_as_async_ones_and_as_one_by_one():
    @stemma.function
    def tree(s, i):
        s += f"Plan {i}." + stemma.gen("x", max_new_tokens=5)
        forks = s.fork(3)
        for k, branch in enumerate(forks):
            branch += f" idea {k}:" + stemma.gen("idea", max_new_tokens=4)
        forks.join()
        s += " best: " + stemma.select("best", ["0", "1", "2"])
        return s["x"], forks[1].text()

    @stemma.function
    async def atree(s, i):
        return tree(s, i)  # programs compose, async or not

    one_by_one = [tree.run(i=i, backend=MockBackend()) for i in range(8)]
    for fn in (tree, atree):
        states = fn.run_batch([{"i": i} for i in range(8)], backend=MockBackend())
        assert [s.text() for s in states] == [s.text() for s in one_by_one]
        assert [s["idea"] for s in states] == [s["idea"] for s in one_by_one]
        assert [s.return_value for s in states] == [s.return_value for s in one_by_one]
        assert [s.usage().calls for s in states] == [s.usage().calls for s in one_by_one]


def test_a_blocking_body_does_not_hold_up_another_program():
    done = {}

    @stemma.function
    def stuck(s):
        s += "a" + stemma.gen("x", max_new_tokens=3)
        s["x"]
        time.sleep(1.0)
        done["stuck"] = time.perf_counter()

    @stemma.function
    def quick(s):
        for _ in range(5):
            s += stemma.gen("y", max_new_tokens=3)
            s["y"]
        done["quick"] = time.perf_counter()

    async def main():
        mock = MockBackend()
        await asyncio.gather(stuck.run_async(backend=mock), quick.run_async(backend=mock))

    start = time.perf_counter()
    asyncio.run(main())
    assert done["quick"] - start < 0.5 < done["stuck"] - start


def test_tool_calls_leave_pause_hints():
    seen = []

    @tool
    def search(q):
        seen.append([c.name for c in run_of(state_box[0]).in_tool()])
        time.sleep(0.05)
        return f"[{q}]"

    @tool(name="fails")
    def broken():
        raise ConnectionError("no route")

    def run_of(state):
        return state._ex.run

    state_box = []

    @stemma.function
    def agent(s):
        state_box.append(s)
        s += "Q:" + stemma.gen("q", max_new_tokens=4)
        s += " R:" + search(s["q"])
        try:
            broken()
        except ConnectionError:
            s += " (offline)"
        return search("again")

    state = agent.run(backend=MockBackend())
    assert state.return_value == "[again]" and f"R:[{state['q']}] (offline)" in state.text()
    calls = run_of(state).tool_calls
    assert [(c.name, c.failed) for c in calls] == \
        [("search", False), ("fails", True), ("search", False)]
    assert all(c.ended >= c.started for c in calls) and calls[0].seconds >= 0.05
    assert calls[0].ended <= calls[1].started and run_of(state).in_tool() == []
    assert seen == [["search"], ["search"]]  # while it runs, the run says it is in the tool


def test_tools_outside_programs_are_their_functions():
    assert slow_tool.__name__ == "slow_tool" and slow_tool.__stemma_tool__ == "slow_tool"
    assert async_tool.__stemma_tool__ == "lookup"
    assert asyncio.run(async_tool(7)) == 7
    assert tool(lambda x: x + 1)(1) == 2
    with pytest.raises(TypeError, match="wraps a function"):
        tool(3)


def test_async_bodies_gather_their_tools_and_read_in_between():
    @stemma.function
    async def fan_out(s):
        s += "x" + stemma.gen("a", max_new_tokens=4)
        results = await asyncio.gather(*(async_tool(k) for k in range(4)))  # concurrently
        s += f" {s['a']}{results}" + stemma.gen("b", max_new_tokens=3)
        return s["b"]

    start = time.perf_counter()
    state = fan_out.run(backend=MockBackend())
    assert time.perf_counter() - start < 3 * PAUSE
    assert state.return_value == state["b"] and "[0, 1, 2, 3]" in state.text()
    assert [c.name for c in state._ex.run.tool_calls] == ["lookup"] * 4


def test_errors_and_cancellation_reach_the_body():
    @stemma.function
    def bad(s):
        s += "a" + stemma.gen("x", max_new_tokens=2)
        s["x"]
        raise KeyError("from the body")

    @stemma.function
    async def abad(s):
        await asyncio.sleep(0)
        s["missing"]

    with pytest.raises(KeyError, match="from the body"):
        bad.run(backend=MockBackend())
    with pytest.raises(stemma.VariableNotGenerated, match="'missing'"):
        abad.run(backend=MockBackend())

    class Never(MockBackend):
        async def generate(self, ids, params, on_text=None):
            await asyncio.Event().wait()

    ended = threading.Event()
    outcome = []

    @stemma.function
    def waits(s):
        s += "a" + stemma.gen("x")
        try:
            s["x"]                                  # never comes: cancelled here
        except BaseException as exc:
            outcome.append(type(exc))
            raise
        finally:
            ended.set()

    async def main():
        task = asyncio.ensure_future(waits.run_async(backend=Never()))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert ended.wait(2) and outcome == [asyncio.CancelledError]


def test_streaming_a_body_that_blocks():
    @stemma.function
    def prog(s):
        s += "Q:" + stemma.gen("a", max_new_tokens=5)
        time.sleep(0.05)
        s += " more:" + stemma.gen("b", max_new_tokens=5)

    state = prog.run(backend=MockBackend(), stream=True)
    deltas = list(state.text_iter())
    assert "".join(deltas) == state.text() == prog.run(backend=MockBackend()).text()
    assert not _body_threads()


def test_contextvars_reach_bodies_and_tools():
    import contextvars
    var = contextvars.ContextVar("var", default="unset")

    @tool
    def read_var():
        return var.get()

    @stemma.function
    def prog(s):
        return var.get(), read_var()

    @stemma.function
    async def aprog(s):
        return var.get(), read_var()

    def inner():
        var.set("set")
        return (prog.run(backend=MockBackend()).return_value,
                aprog.run(backend=MockBackend()).return_value)

    assert contextvars.copy_context().run(inner) == (("set", "set"), ("set", "set"))


def test_the_thread_pool_is_bounded_and_reservable(monkeypatch):
    from stemma.lang import suspend
    monkeypatch.setattr(suspend, "DEFAULT_THREADS", 2)
    peak, running, lock = [0], [0], threading.Lock()

    @stemma.function
    def prog(s):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.1)
        with lock:
            running[0] -= 1
        s += "a" + stemma.gen("x", max_new_tokens=2)

    async def unreserved():
        await asyncio.gather(*(prog.run_async(backend=MockBackend()) for _ in range(6)))

    asyncio.run(unreserved())
    assert peak[0] == 2  # two threads: the other bodies waited on the loop for one

    async def reserved():
        suspend.reserve_threads(asyncio.get_running_loop(), 6)
        await asyncio.gather(*(prog.run_async(backend=MockBackend()) for _ in range(6)))

    peak[0] = 0
    asyncio.run(reserved())
    assert peak[0] == 6
    peak[0] = 0  # run_batch reserves its max_concurrency (as SGLang's num_threads makes threads)
    prog.run_batch([()] * 6, backend=MockBackend(), max_concurrency=6)
    assert peak[0] == 6


def test_a_body_can_run_another_program_and_loops_are_freed():
    import gc
    import weakref

    @stemma.function
    def inner(s):
        s += "i" + stemma.gen("x", max_new_tokens=3)

    @stemma.function
    def outer(s):
        s += "o" + stemma.gen("x", max_new_tokens=3)
        state = inner.run(backend=MockBackend())  # on this body's thread, with a loop of its own
        return s["x"], state["x"], state.text()

    state = outer.run(backend=MockBackend())
    assert state.return_value == (state["x"], inner.run(backend=MockBackend())["x"],
                                  inner.run(backend=MockBackend()).text())
    loops = [weakref.ref(outer.run(backend=MockBackend())._ex.run.loop) for _ in range(5)]
    gc.collect()
    assert all(ref() is None for ref in loops)


def test_a_tool_call_ends_a_trace_instead_of_running():
    from stemma.lang.tool import tracing
    from stemma.lang.tracer import trace
    ran = []

    @tool
    def fetch():
        ran.append(1)
        return "docs"

    def body(s):
        s += "constant "
        s += fetch()

    with tracing():
        assert [n.value for n in trace(body).nodes] == ["constant "]
    assert ran == []
