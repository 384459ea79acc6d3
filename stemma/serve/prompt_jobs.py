"""Text prompts too long to tokenize on the gateway's loop, tokenized on a worker thread.

The loop serves every client: tokenizing a prompt of megabytes on it (5.8 s for 8 MB on the
default model's tokenizer) stalled every other stream for as long. The tokenizer releases the
GIL while it encodes, so on a worker thread it costs the loop nothing. Shorter prompts stay on
the loop: they take a few milliseconds, and a thread hop would only add latency.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from stemma import protocol as P
from stemma.text.tokenizer import encode_prompt

INLINE_CHARS = 8192  # text prompts up to this many characters are tokenized on the loop
MAX_QUEUED_CHARS = 256 * 2**20  # text waiting for the worker, all clients together: past it, `overloaded`


@dataclass
class PromptJob:
    peer: bytes | int
    msg: P.GenerateReq
    ids: Future          # the token ids, or a ValueError for a prompt that has none
    aborted: bool = False  # an Abort came meanwhile: sent on after the request


class PromptJobs:
    """The prompts being tokenized, by (peer, rid), in the order they came. Invariant: a job's
    request is not in the gateway's routes until `finished` hands it back.

    One worker tokenizes one prompt at a time, taking the peers in turn (each peer's own prompts
    in the order they came): a client that sends many long prompts delays another client's by at
    most one of its prompts, not by all of them (15 prompts of 4 MB held one 8 kB prompt 38 s).
    `_queued` and `_running` are shared with the worker thread, under `_lock`."""

    def __init__(self):
        self.jobs: dict[tuple[bytes | int, str], PromptJob] = {}
        self.pool: ThreadPoolExecutor | None = None  # one worker
        self._lock = threading.Lock()
        self._queued: dict[bytes | int, deque[tuple[PromptJob, Any]]] = {}  # peer -> its jobs, peers in turn order
        self._running = False

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def full(self, msg: P.GenerateReq) -> bool:
        """Whether taking `msg` would hold more than MAX_QUEUED_CHARS of prompts (each frame is
        bounded, their number was not: a client that never reads could pile up gigabytes)."""
        held = sum(len(job.msg.prompt) for job in self.jobs.values() if not job.ids.done())
        return held + len(msg.prompt) > MAX_QUEUED_CHARS

    @staticmethod
    def wanted(msg: P.GenerateReq, tokenizer: Any) -> bool:
        return msg.input_ids is None and tokenizer is not None and len(msg.prompt) > INLINE_CHARS

    def submit(self, peer: bytes | int, msg: P.GenerateReq, tokenizer: Any) -> bool:
        """False when this peer already has a prompt of that id being tokenized."""
        if (peer, msg.rid) in self.jobs:
            return False
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="stemma-tokenize")
        job = PromptJob(peer, msg, Future())
        self.jobs[peer, msg.rid] = job
        with self._lock:
            self._queued.setdefault(peer, deque()).append((job, tokenizer))
            self._start_next()
        return True

    def _start_next(self) -> None:
        """Hands the next peer's next job to the worker, unless it is busy (holding `_lock`)."""
        while not self._running and self._queued:
            peer = next(iter(self._queued))
            jobs = self._queued.pop(peer)
            job, tokenizer = jobs.popleft()
            if jobs:
                self._queued[peer] = jobs  # back of the turn order
            if job.ids.set_running_or_notify_cancel():
                self._running = True
                self.pool.submit(self._tokenize, job, tokenizer)

    def _tokenize(self, job: PromptJob, tokenizer: Any) -> None:
        try:
            job.ids.set_result(encode_prompt(tokenizer, job.msg.prompt))
        except BaseException as exc:  # a ValueError for a prompt that has no tokens
            job.ids.set_exception(exc)
        finally:
            with self._lock:
                self._running = False
                self._start_next()

    def abort(self, peer: bytes | int, rid: str) -> bool:
        """Marks the job aborted; False when there is none."""
        job = self.jobs.get((peer, rid))
        if job is not None:
            job.aborted = True
        return job is not None

    def drop_peer(self, peer: bytes | int) -> None:
        with self._lock:
            self._queued.pop(peer, None)
        for key in [k for k in self.jobs if k[0] == peer]:
            self.jobs.pop(key).ids.cancel()

    def finished(self) -> list[PromptJob]:
        """The jobs whose tokenization ended, removed; each one's `ids` holds its result."""
        done = [key for key, job in self.jobs.items() if job.ids.done()]
        return [self.jobs.pop(key) for key in done]

    def take_all(self) -> list[PromptJob]:
        """Every job, removed and cancelled where not started (the server is stopping)."""
        jobs = list(self.jobs.values())
        self.jobs.clear()
        with self._lock:
            self._queued.clear()
        for job in jobs:
            job.ids.cancel()
        return jobs

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
