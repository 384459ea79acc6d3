"""Text prompts too long to tokenize on the gateway's loop, tokenized on a worker thread.

The loop serves every client: tokenizing a prompt of megabytes on it (5.8 s for 8 MB on the
default model's tokenizer) stalled every other stream for as long. The tokenizer releases the
GIL while it encodes, so on a worker thread it costs the loop nothing. Shorter prompts stay on
the loop: they take a few milliseconds, and a thread hop would only add latency.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from stemma import protocol as P
from stemma.text.tokenizer import encode_prompt

INLINE_CHARS = 8192  # text prompts up to this many characters are tokenized on the loop


@dataclass
class PromptJob:
    peer: bytes | int
    msg: P.GenerateReq
    ids: Future          # the token ids, or a ValueError for a prompt that has none
    aborted: bool = False  # an Abort came meanwhile: sent on after the request


class PromptJobs:
    """The prompts being tokenized, by (peer, rid), in the order they came. Invariant: a job's
    request is not in the gateway's routes until `finished` hands it back."""

    def __init__(self):
        self.jobs: dict[tuple[bytes | int, str], PromptJob] = {}
        self.pool: ThreadPoolExecutor | None = None  # one worker: jobs finish in order

    def __bool__(self) -> bool:
        return bool(self.jobs)

    @staticmethod
    def wanted(msg: P.GenerateReq, tokenizer: Any) -> bool:
        return msg.input_ids is None and tokenizer is not None and len(msg.prompt) > INLINE_CHARS

    def submit(self, peer: bytes | int, msg: P.GenerateReq, tokenizer: Any) -> bool:
        """False when this peer already has a prompt of that id being tokenized."""
        if (peer, msg.rid) in self.jobs:
            return False
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="stemma-tokenize")
        ids = self.pool.submit(encode_prompt, tokenizer, msg.prompt)
        self.jobs[peer, msg.rid] = PromptJob(peer, msg, ids)
        return True

    def abort(self, peer: bytes | int, rid: str) -> bool:
        """Marks the job aborted; False when there is none."""
        job = self.jobs.get((peer, rid))
        if job is not None:
            job.aborted = True
        return job is not None

    def drop_peer(self, peer: bytes | int) -> None:
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
        for job in jobs:
            job.ids.cancel()
        return jobs

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
