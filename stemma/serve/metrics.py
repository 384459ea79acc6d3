"""The server's Prometheus metrics, named as vLLM and SGLang users chart them, under `stemma:`.

The gateway observes every generate request, whichever front (ZeroMQ or HTTP) it came by:
- from each finished sequence's meta (measured in the engine): TTFT, one inter-token latency per
  output token after the first, end-to-end latency, queue time, and its token counts;
- from the engine's stats, polled by the gateway (never by a scrape): the gauges, and counters for
  the running totals among them (speculated and accepted tokens, ended programs, the router's
  decisions), as Prometheus's rate() reads them.
A sequence is one of a request's `n`; counts are per sequence, as the engine's counters are.
Scraping only reads this registry (on the HTTP thread); it never waits on the engine.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "stemma:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ABORT = "abort"
GAUGES = {  # gauge suffix -> the engine stats key it shows
    "num_requests_running": "running",
    "num_requests_waiting": "queue",
    "num_grammar_queue_reqs": "grammar_queue",
    "kv_cache_usage_perc": "kv_usage",  # evictable cached slots count as free, as vLLM's
    "cache_hit_rate": "cache_hit_rate",
    # programs (stemma.engine.programs): live ones, those paused with KV retained
    "num_programs_live": "programs_live",
    "num_programs_retained": "programs_retained",
    # speculative decoding (engines with speculative on): rates
    "spec_decode_draft_acceptance_rate": "spec_acceptance_rate",
    "spec_decode_mean_accepted_length": "spec_mean_accepted",
}
TOTALS = {  # counter name (exported with _total) -> the engine stats key of the running total it follows
    "num_programs_ended": "programs_ended",
    "spec_decode_num_draft_tokens": "spec_proposed",
    "spec_decode_num_accepted_tokens": "spec_accepted",
}


class FollowedTotal:
    """A counter that follows a running total read from stats (by labels): it grows by the
    total's increase since the last read. A total that fell (its engine restarted and counts
    again from 0) is taken as the new base, adding nothing, so a summed total over replicas is
    not counted twice when one of them restarts."""

    def __init__(self, counter: Counter):
        self.counter = counter
        self.last: dict[tuple, float] = {}

    def follow(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        last, self.last[key] = self.last.get(key, 0), value
        child = self.counter.labels(**labels) if labels else self.counter  # exported from the first read
        if value > last:
            child.inc(value - last)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, registry=r, buckets=buckets)

        def counter(name: str, doc: str, labels=()) -> Counter:
            return Counter(PREFIX + name, doc, labelnames=labels, registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish, per sequence.",
                             LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first admission.",
                               LATENCY_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of finished sequences.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.cached_tokens = counter("cached_tokens_total", "Prompt tokens served from the cache.")
        self.success = counter("request_success_total", "Sequences finished, by finish reason.",
                               ("finished_reason",))
        self.aborted = counter("num_aborted_requests_total", "Sequences aborted.")
        self.retractions = counter("retractions_total", "Retractions of finished sequences.")
        self.gauges = {suffix: Gauge(PREFIX + suffix, f"The engine's {key}.", registry=r)
                       for suffix, key in GAUGES.items()}
        self.totals = {suffix: FollowedTotal(counter(suffix, f"The engine's {key}."))
                       for suffix, key in TOTALS.items()}
        # latency targets (stemma.engine.slo): per priority, from each finished sequence's meta
        self.slo_requests = counter("slo_requests_total", "Finished sequences that had a latency "
                                    "target, by priority.", ("priority",))
        self.slo_met = counter("slo_met_total", "Of those, the ones that met every target, by "
                               "priority.", ("priority",))
        self.step_predicted = Gauge(PREFIX + "step_time_predicted_seconds", "The step-cost model's "
                                    "prediction for the engine's latest step.", registry=r)
        self.step_actual = Gauge(PREFIX + "step_time_seconds", "The engine's latest step, measured.",
                                 registry=r)
        self.step_error = Gauge(PREFIX + "step_time_prediction_error", "Median absolute relative "
                                "error of the step-cost model's recent predictions.", registry=r)
        # replicas (serve --dp): each one's gauges, labelled, and the router's figures
        self.replica_gauges = {suffix: Gauge(PREFIX + "replica_" + suffix, f"One replica's {key}.",
                                             ("replica",), registry=r)
                               for suffix, key in GAUGES.items()}
        replica_totals = {**TOTALS, "prompt_tokens": "prompt_tokens", "cached_tokens": "cached_tokens"}
        self.replica_totals = {key: FollowedTotal(counter("replica_" + suffix, f"One replica's {key}.",
                                                          ("replica",)))
                               for suffix, key in replica_totals.items()}
        self.routed = FollowedTotal(counter("router_requests", "Requests the router sent to each "
                                            "replica.", ("replica",)))
        self.route_reasons = FollowedTotal(counter("router_decisions", "The router's decisions by "
                                                   "reason (cache, load, balance, program, "
                                                   "round_robin, least_load).", ("reason",)))
        self.router_tree = Gauge(PREFIX + "router_tree_tokens", "Tokens in the router's view of "
                                 "each replica's cache, by tree (exact, approx).",
                                 ("replica", "tree"), registry=r)

    def on_finished(self, finish_reason: str | None, meta: dict[str, Any]) -> None:
        """One finished sequence (a Finished message's reason and meta)."""
        if meta.get("ttft") is not None:
            self.ttft.observe(meta["ttft"])
        for gap in meta.get("itl") or ():
            self.itl.observe(gap)
        if meta.get("latency") is not None:
            self.e2e.observe(meta["latency"])
        if meta.get("queue_time") is not None:
            self.queue.observe(meta["queue_time"])
        self.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        self.generation_tokens.inc(meta.get("completion_tokens", 0))
        self.cached_tokens.inc(meta.get("cached_tokens", 0))
        self.retractions.inc(meta.get("retractions", 0))
        slo = meta.get("slo")
        if slo:
            self.slo_requests.labels(priority=str(slo.get("priority", 0))).inc()
            if slo.get("met"):
                self.slo_met.labels(priority=str(slo.get("priority", 0))).inc()
        if finish_reason == ABORT:
            self.aborted.inc()
        else:
            self.success.labels(finished_reason=str(finish_reason)).inc()

    def on_stats(self, stats: dict[str, Any]) -> None:
        for suffix, key in GAUGES.items():
            if key in stats:
                self.gauges[suffix].set(stats[key])
        for suffix, key in TOTALS.items():
            if key in stats:
                self.totals[suffix].follow(stats[key])
        for replica in stats.get("replicas") or ():
            label = str(replica["replica"])
            for suffix, key in GAUGES.items():
                if key in replica:
                    self.replica_gauges[suffix].labels(replica=label).set(replica[key])
            for key, total in self.replica_totals.items():
                if key in replica:
                    total.follow(replica[key], replica=label)
        router = stats.get("router")
        if router:
            for i, count in enumerate(router["routed"]):
                self.routed.follow(count, replica=str(i))
            for reason, count in router["reasons"].items():
                self.route_reasons.follow(count, reason=reason)
            for tree, sizes in router["tree_tokens"].items():
                for i, size in enumerate(sizes):
                    self.router_tree.labels(replica=str(i), tree=tree).set(size)
        cost = stats.get("step_cost") or {}
        for gauge, key, scale in ((self.step_predicted, "last_predicted_ms", 1e-3),
                                  (self.step_actual, "last_actual_ms", 1e-3),
                                  (self.step_error, "median_abs_error", 1.0)):
            if cost.get(key) is not None:
                gauge.set(cost[key] * scale)

    def render(self) -> bytes:
        return generate_latest(self.registry)
