"""The programs the engine has had calls from: their service, their pauses, their KV's retention.

A request that carries a ProgramCall (stemma.program_call) is booked on its program's record,
which its first call makes and every later call (forks included) shares. The record is what the
program-aware parts read:

- `schedule_policy="program"` (policy.py) orders the waiting queue by the record's attained
  service: the tokens computed for the program so far (prefill and decode), least first;
- `radix_eviction="program"` (`eviction_rank`) evicts, in order: the KV of ended programs, then
  KV whose retention has expired, then KV of no program (least recently used first within each),
  and last of all the KV of programs that will call again, until its retention expires: of
  those, first the program expected back last, and last those with a call in flight (as KVFlow
  orders by steps until reuse, where LRU would evict the program paused longest, the one most
  likely back soonest);
- with both, admission respects retention (`RetentionGuard`): a waiting request that would have
  to evict KV retained for other programs, or take the room the active programs' next calls are
  expected to grow into, waits, unless it resumes its own program or has starved (or, as the
  scheduler decides, may preempt a running request by priority: retained KV ranks below
  running requests). While nothing runs, only the KV of paused programs (expected back) holds
  a call back, never the KV of programs whose own calls wait in the queue, so waiting calls
  cannot hold each other up; the engine then sleeps until that retention ends, a held call
  starves, or a call arrives. Running requests are never held back by it: their growth evicts
  retained KV, last.

Retention: when a call that `continues` finishes, the program's KV is kept until `keep_until` =
now + a time-to-live of `RETENTION_FACTOR` x the pause expected before its next call, plus
`RETENTION_SLACK_S`, at most `program_retention_s`. The pause expected is the larger of the call's
own hint (`pause_s`) and the longest of the program's recent measured pauses (from a call's finish
to its next call's arrival, while none ran); a program with neither uses the median of every
program's recent pauses, and `DEFAULT_PAUSE_S` before any was measured. Retention is a priority
only: retained KV is still evicted when nothing else is left, and a locked node is never evicted
(the tree's rule), so retention never blocks a running request.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from stemma.cache.radix_tree import Node, RadixTree
    from stemma.engine.request import Request
    from stemma.engine_config import EngineConfig

RETENTION_FACTOR = 1.5
RETENTION_SLACK_S = 0.1
DEFAULT_PAUSE_S = 1.0
RECENT_PAUSES = 8         # measured pauses kept per program
GLOBAL_PAUSES = 256       # and over all programs
MAX_RECORDS = 4096        # program records kept; past it, ended or idle ones are dropped first
RESUMED_SHARE = 0.9       # a call is resumed when this share of its program's last KV is cached


@dataclass(eq=False)
class ProgramRecord:
    program_id: str
    first_arrival: float
    starve_after_s: float     # a call of it waiting longer goes first (policy "program")
    calls: int = 0
    in_flight: int = 0        # calls submitted and not finished
    attained: int = 0         # tokens computed for it so far: its attained service
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    wait_s: float = 0.0       # summed over its calls: arrival to first admission
    compute_s: float = 0.0    # and first admission to finish
    last_finish: float | None = None
    last_kv_len: int = 0      # tokens of KV its last finished call left cached
    pauses: deque = field(default_factory=lambda: deque(maxlen=RECENT_PAUSES))
    pause_hint: float | None = None
    keep_until: float = 0.0   # its cached KV is retained until then (perf_counter time)
    ended: bool = False

    def retained(self, now: float) -> bool:
        """Paused, with its KV retained at `now`."""
        return not self.ended and self.in_flight == 0 and self.keep_until > now

    def active(self, now: float) -> bool:
        """Running a call, or paused with its KV retained."""
        return not self.ended and (self.in_flight > 0 or self.keep_until > now)

    def as_dict(self) -> dict:
        prompt = self.prompt_tokens
        return {"program_id": self.program_id, "calls": self.calls, "in_flight": self.in_flight,
                "tokens": self.attained, "prompt_tokens": prompt, "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens,
                "cached_share": self.cached_tokens / prompt if prompt else 0.0,
                "wait_s": round(self.wait_s, 4), "compute_s": round(self.compute_s, 4),
                "ended": self.ended}


class Programs:
    """The program records, by program id, least recently used first."""

    def __init__(self, retention_max_s: float, starvation_s: float,
                 clock: Callable[[], float] = time.perf_counter, max_records: int = MAX_RECORDS):
        self.retention_max_s = retention_max_s
        self.starvation_s = starvation_s
        self.clock = clock
        self.max_records = max_records
        self.records: OrderedDict[str, ProgramRecord] = OrderedDict()
        self.recent_pauses: deque[float] = deque(maxlen=GLOBAL_PAUSES)
        self.recent_growth: deque[int] = deque(maxlen=GLOBAL_PAUSES)  # KV tokens a program adds per call
        self.ended_count = 0

    @classmethod
    def of(cls, config: EngineConfig) -> Programs:
        return cls(config.program_retention_s, config.program_starvation_s)

    def rank(self, config: EngineConfig) -> Callable[[Node], tuple[int, float]] | None:
        """The radix cache's eviction rank under config.radix_eviction (None: LRU)."""
        return self.eviction_rank if config.radix_eviction == "program" else None

    # ---- a call's life ----
    def on_submit(self, req: Request) -> None:
        """Books a new call of req's program (req.call is set) and attaches the record."""
        call = req.call
        now = self.clock()
        rec = self.records.get(call.program_id)
        if rec is None:
            self._trim(room=1)
            rec = ProgramRecord(call.program_id, req.arrival, self.starvation_s)
            self.records[call.program_id] = rec
        else:
            self.records.move_to_end(call.program_id)
            if rec.in_flight == 0 and rec.last_finish is not None:
                pause = max(now - rec.last_finish, 0.0)
                rec.pauses.append(pause)
                self.recent_pauses.append(pause)
        rec.calls += 1
        rec.in_flight += 1
        if rec.ended:  # a call after EndProgram: the id is live again
            rec.ended = False
            self.ended_count -= 1
        req.program = rec

    def on_admitted(self, req: Request) -> None:
        """At its first admission: its queue time."""
        if req.program is not None and req.admit_time is not None:
            req.program.wait_s += req.admit_time - req.arrival

    def on_computed(self, req: Request, tokens: int) -> None:
        if req.program is not None:
            req.program.attained += tokens

    def on_finish(self, req: Request, kv_len: int) -> None:
        """Its call ended with `kv_len` tokens of KV going to the cache: books it and, when the
        program continues, sets the retention of the program's KV."""
        rec = req.program
        if rec is None:
            return
        now = self.clock()
        assert rec.in_flight > 0, f"program {rec.program_id}: a call finished twice"
        rec.in_flight -= 1
        rec.prompt_tokens += len(req.input_ids)
        rec.cached_tokens += req.cached_tokens
        rec.generated_tokens += len(req.output_ids)
        if req.admit_time is not None:
            rec.compute_s += now - req.admit_time
        rec.last_finish = now
        if kv_len:  # a call that never ran (aborted while waiting) leaves the last KV as it was
            if rec.last_kv_len and kv_len > rec.last_kv_len:
                self.recent_growth.append(kv_len - rec.last_kv_len)
            rec.last_kv_len = max(rec.last_kv_len, kv_len) if rec.in_flight else kv_len
        if req.call.pause_s is not None:
            rec.pause_hint = req.call.pause_s
        if req.call.continues:
            rec.keep_until = now + self.ttl(rec)
        elif rec.in_flight == 0:
            self._end(rec)

    def end(self, program_id: str) -> None:
        """The program calls no more (EndProgram); unknown ids are ignored."""
        rec = self.records.get(program_id)
        if rec is not None:
            self._end(rec)

    # ---- retention ----
    def ttl(self, rec: ProgramRecord) -> float:
        """Seconds to keep rec's KV after a call: see the module docstring."""
        expected = max([rec.pause_hint or 0.0, *rec.pauses])
        if rec.pause_hint is None and not rec.pauses:
            expected = statistics.median(self.recent_pauses) if self.recent_pauses else DEFAULT_PAUSE_S
        return min(RETENTION_FACTOR * expected + RETENTION_SLACK_S, self.retention_max_s)

    def eviction_rank(self, node: Node) -> tuple[int, float]:
        """Eviction order (lowest first) of an unlocked leaf under radix_eviction="program".
        Retained KV goes last, and among it first the KV whose program is expected back last
        (its retention ends last); a program with a call in flight is needed now."""
        rec = node.owner
        if rec is None:
            return 2, node.last_access
        if rec.ended:
            return 0, node.last_access
        if rec.in_flight:
            return 3, math.inf
        if rec.keep_until > self.clock():
            return 3, -rec.keep_until
        return 1, node.last_access

    def active(self) -> int:
        """Programs running a call or paused with their KV retained."""
        now = self.clock()
        return sum(1 for r in self.records.values() if r.active(now))

    def growth(self) -> float:
        """The mean KV tokens a program's call adds to its context (0 before any is measured)."""
        return statistics.fmean(self.recent_growth) if self.recent_growth else 0.0

    def starves_at(self, req: Request) -> float:
        """When req will have waited past the starvation bound (its program's, or the engine's)."""
        bound = req.program.starve_after_s if req.program is not None else self.starvation_s
        return req.arrival + bound

    def starved(self, req: Request) -> bool:
        return self.clock() > self.starves_at(req)

    @staticmethod
    def resumed(req: Request, cached: int) -> bool:
        """Whether req continues its program with the program's last KV still cached."""
        rec = req.program
        return rec is not None and rec.last_kv_len > 0 and cached >= RESUMED_SHARE * rec.last_kv_len

    # ---- stats ----
    def stats(self, limit: int = 32) -> dict:
        """Counts, and the `limit` most recently active programs' records. A program is live
        while a call of it is in flight or its KV is retained: one whose client never ends it
        stops counting once its retention is over (its record stays, up to max_records)."""
        now = self.clock()
        recent = list(self.records.values())[-limit:][::-1]
        return {"programs_live": self.active(), "programs_ended": self.ended_count,
                "programs_retained": sum(1 for r in self.records.values() if r.retained(now)),
                "programs": [r.as_dict() for r in recent]}

    def _end(self, rec: ProgramRecord) -> None:
        if not rec.ended:
            rec.ended = True
            self.ended_count += 1

    def _trim(self, room: int = 0) -> None:
        """Drops records past max_records less `room`, oldest first among each kind: ended ones,
        then idle ones whose retention is over, then paused ones still retained (never one with
        a call in flight). A dropped record counts as ended (the nodes that still point to it
        evict first), so a retained program goes only when nothing else can."""
        excess = len(self.records) + room - self.max_records
        if excess <= 0:
            return
        now = self.clock()
        kinds = [[], [], []]  # ended, idle past retention, retained
        for pid, r in self.records.items():
            if r.ended or r.in_flight == 0:
                kinds[0 if r.ended else 2 if r.retained(now) else 1].append(pid)
        for pid in [pid for kind in kinds for pid in kind][:excess]:
            self._end(self.records.pop(pid))


class RetentionGuard:
    """One step's admission check against retained KV (module docstring). `free` is what
    admissions may take without evicting retained KV: free slots plus the unlocked tokens that
    can go without any retained token going first (a node above retained KV is evicted only
    after it), less the growth the active programs' next calls are expected to add (one mean
    growth each). With `protect_waiting` off (nothing runs), the KV of programs whose calls wait
    in the queue is not retained here. Made on the first check of the step (a step that checks
    nothing walks no tree); each admission takes its uncached tokens from `free`."""

    def __init__(self, programs: Programs, tree: RadixTree, available: int, protect_waiting: bool = True):
        self.programs = programs
        self.tree = tree
        self.available = available
        self.protect_waiting = protect_waiting
        self.retained: dict[int, int] | None = None  # id(program record) -> its retained tokens
        self.free = 0.0
        self.until = math.inf  # the earliest end of a paused program's retention counted here
        self.held: list[Request] = []  # the requests `fits` refused

    def fits(self, req: Request, cached: int) -> bool:
        """Whether req may be admitted now: it resumes its own program, has starved, was running
        (retracted: retained KV never holds back a running request), or needs no more than `free`."""
        if self.retained is None:
            self._measure()
        if not self.retained:
            return True
        exempt = Programs.resumed(req, cached) or self.programs.starved(req) or req.retractions > 0
        if exempt or len(req.tokens) - cached <= self.free:
            return True
        self.held.append(req)
        return False

    def take(self, req: Request, cached: int) -> None:
        """req was admitted: its uncached tokens are taken."""
        self.free -= len(req.tokens) - cached

    def wakes_at(self) -> float | None:
        """When a refusal of this step may turn into an admission with no new arrival: the first
        retention counted here ends, or a refused request starves (None: nothing was refused)."""
        if not self.held:
            return None
        return min(self.until, *(self.programs.starves_at(r) for r in self.held))

    def _retains(self, node: Node) -> bool:
        rec = node.owner
        return (node.lock_ref == 0 and rec is not None and self.programs.eviction_rank(node)[0] == 3
                and (self.protect_waiting or not rec.in_flight))

    def _measure(self) -> None:
        retained: dict[int, int] = defaultdict(int)
        pinned: set[int] = set()  # nodes that are retained or hold retained KV below them
        freeable = 0
        for node in reversed(list(self.tree.nodes())):  # children before their parents
            if self._retains(node):
                retained[id(node.owner)] += len(node.key)
                pinned.add(id(node))
                if not node.owner.in_flight:
                    self.until = min(self.until, node.owner.keep_until)
            elif any(id(c) in pinned for c in node.children.values()):
                pinned.add(id(node))
            elif node.lock_ref == 0:
                freeable += len(node.key)
        headroom = self.programs.active() * self.programs.growth()
        self.free = self.available + freeable - headroom
        self.retained = retained
