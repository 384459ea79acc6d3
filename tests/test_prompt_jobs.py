"""The gateway's long text prompts, tokenized on a worker thread (serve.prompt_jobs): submitting
never waits for the tokenizer, jobs come back in order once tokenized, and aborts, dropped
peers and a second request under the same id are handled before the request is routed."""
import threading
import time

import pytest

from stemma import protocol as P
from stemma.serve.prompt_jobs import INLINE_CHARS, PromptJobs

LONG = "word " * (INLINE_CHARS // 5 + 1)


class SlowTokenizer:
    """Token ids of a prompt once `go` is set; a prompt of spaces has none."""

    def __init__(self):
        self.go = threading.Event()

    def __call__(self, text):
        assert self.go.wait(30)
        return type("Encoded", (), {"input_ids": [len(w) for w in text.split()]})()


def req(rid, prompt=LONG):
    return P.GenerateReq(rid=rid, prompt=prompt)


def finished(jobs, count):
    deadline, out = time.monotonic() + 30, []
    while len(out) < count:
        assert time.monotonic() < deadline
        out += jobs.finished()
        time.sleep(0.001)
    return out


def test_only_long_text_prompts_go_to_the_thread():
    tok = SlowTokenizer()
    assert PromptJobs.wanted(req("a"), tok)
    assert not PromptJobs.wanted(req("b", "word " * 10), tok)
    assert not PromptJobs.wanted(P.GenerateReq(rid="c", input_ids=[1] * INLINE_CHARS), tok)
    assert not PromptJobs.wanted(req("d"), None)   # no tokenizer: refused on the loop


def test_jobs_wait_for_the_tokenizer_off_the_loop_and_come_back_in_order():
    tok, jobs = SlowTokenizer(), PromptJobs()
    try:
        t0 = time.monotonic()
        assert jobs.submit(b"p", req("a"), tok) and jobs.submit(b"p", req("b"), tok)
        assert jobs.submit(b"q", req("a"), tok)        # ids are per peer
        assert not jobs.submit(b"p", req("a"), tok)    # in flight on this peer already
        assert time.monotonic() - t0 < 1 and jobs.finished() == [] and jobs
        assert jobs.abort(b"p", "b") and not jobs.abort(b"p", "nope")
        tok.go.set()
        done = finished(jobs, 3)
        assert [(j.peer, j.msg.rid, j.aborted) for j in done] == [(b"p", "a", False), (b"p", "b", True),
                                                                  (b"q", "a", False)]
        assert done[0].ids.result() == [4] * (INLINE_CHARS // 5 + 1) and not jobs
    finally:
        jobs.close()


def test_a_dropped_peer_loses_its_jobs_and_a_stop_takes_the_rest():
    tok, jobs = SlowTokenizer(), PromptJobs()
    try:
        for peer, rid in [(b"p", "a"), (b"q", "a"), (b"q", "b"), (7, "c")]:
            assert jobs.submit(peer, req(rid), tok)
        jobs.drop_peer(b"q")
        assert sorted(str(k) for k in jobs.jobs) == sorted(str(k) for k in [(b"p", "a"), (7, "c")])
        assert [(j.peer, j.msg.rid) for j in jobs.take_all()] == [(b"p", "a"), (7, "c")] and not jobs
    finally:
        tok.go.set()
        jobs.close()


def test_a_prompt_without_tokens_comes_back_as_its_error():
    tok, jobs = SlowTokenizer(), PromptJobs()
    tok.go.set()
    try:
        assert jobs.submit(b"p", req("blank", " " * (INLINE_CHARS + 1)), tok)
        (job,) = finished(jobs, 1)
        with pytest.raises(ValueError, match="at least one token"):
            job.ids.result()
    finally:
        jobs.close()


def test_peers_take_turns():
    """One worker, the peers in turn: a client's many long prompts delay another client's by
    one prompt, not by all of them (they were tokenized first come, first served)."""
    order = []

    class Recording:
        def __call__(self, text):
            order.append(text.split()[0])
            time.sleep(0.01)
            return type("Encoded", (), {"input_ids": [1]})()

    tok, jobs = Recording(), PromptJobs()
    try:
        for i in range(6):
            assert jobs.submit(b"flood", req(f"f{i}", f"f{i} " + LONG), tok)
        assert jobs.submit(b"other", req("o", "o " + LONG), tok)
        assert jobs.submit(b"third", req("t", "t " + LONG), tok)
        finished(jobs, 8)
        assert order.index("o") <= 2 and order.index("t") <= 3, order
        assert [w for w in order if w.startswith("f")] == [f"f{i}" for i in range(6)]  # each peer's in order
    finally:
        jobs.close()


def test_the_text_waiting_is_bounded(monkeypatch):
    """Each frame is bounded, their number was not: a client that never reads could make the
    gateway hold gigabytes of prompts. Past the bound the gateway answers `overloaded`."""
    from stemma.serve import prompt_jobs
    monkeypatch.setattr(prompt_jobs, "MAX_QUEUED_CHARS", 3 * len(LONG))
    tok, jobs = SlowTokenizer(), PromptJobs()
    try:
        for rid in "abc":
            assert not jobs.full(req(rid)) and jobs.submit(b"p", req(rid), tok)
        assert jobs.full(req("d"))
        tok.go.set()
        finished(jobs, 3)
        assert not jobs.full(req("d"))  # tokenized: no longer held
    finally:
        jobs.close()
