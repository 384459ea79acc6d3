"""The cache dashboard: `GET /dashboard`, one self-contained page (dashboard.html: inline CSS, JS
and SVG, nothing fetched from elsewhere), which polls `GET /dashboard/data` once a second.

The data holds the radix tree's biggest subtrees (from the engine's CacheTree reply, each node
with the decoded text of its path), the running and waiting requests, and the last minutes of the
server's one-second stats samples as chart series.

A node's path text is the concatenation of the edges from the top of the listing down to it.
The engine sends only the first tokens of a long edge, so where an edge is cut the text shows
ELLIPSIS in place of the missing tokens; a node whose parent is not listed (never so in a
CacheTree from stemma's engine, whose listing is closed upward) has an unknown prefix, shown as
ELLIPSIS first.

The page itself holds no data, and a browser opening it cannot send a Bearer header, so it is
served without the API key; the data is behind `state.auth`. Opened as
`/dashboard#key=<API key>`, the page sends the key as `Authorization: Bearer <key>` with each poll
(a URL fragment never leaves the browser).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from fastapi import APIRouter, Depends, Query
from fastapi.responses import HTMLResponse

from stemma import protocol as P
from stemma.serve.http.errors import ApiError

PAGE = Path(__file__).with_name("dashboard.html")
ELLIPSIS = "…"
STATES = ("running", "waiting", "grammar")

Decode = Callable[[Sequence[int]], str]
Runs = tuple[tuple[int, ...], ...]  # a path's known tokens: ELLIPSIS stands between two runs


@dataclass(frozen=True)
class DashboardConfig:
    node_limit: int = 20      # subtrees asked of the engine by default
    window_s: float = 300.0   # the charts' span, back from the latest sample
    prefix_chars: int = 40    # the end of the parent's text shown before a node's own text
    edge_chars: int = 120     # the start of a node's own text shown
    text_chars: int = 2000    # the path text kept for the tooltip (its middle is cut)


def dashboard_router(state, config: DashboardConfig = DashboardConfig()) -> APIRouter:
    """GET /dashboard (the static page: open) and GET /dashboard/data (behind `state.auth`)."""
    router = APIRouter()
    page = PAGE.read_text(encoding="utf-8")

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/data", dependencies=[Depends(state.auth)])
    async def dashboard_data(limit: int = Query(config.node_limit, ge=1, le=1000)) -> dict[str, Any]:
        return await build_data(state, limit, config)

    return router


async def build_data(state, limit: int, config: DashboardConfig) -> dict[str, Any]:
    """What one poll of the page gets: {time, error, nodes, requests, series, latest, window_s}.
    An engine that does not answer leaves the tables empty and says why in `error`; the charts,
    which come from the server's own samples, are there regardless."""
    nodes: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    error = None
    try:
        reply = await state.call(P.GetCacheTree(rid=state.new_rid(), limit=limit))
    except unavailable_errors(state) as exc:
        reply, error = None, f"the engine is unavailable: {exc}" if str(exc) else "the engine is unavailable"
    if isinstance(reply, P.CacheTree):
        nodes = node_rows(reply.nodes, decoder(state.tokenizer), config)
        requests = request_rows(reply.requests)
    elif isinstance(reply, P.ErrorMsg):
        error = f"{reply.code}: {reply.message}"
    elif reply is not None:
        error = f"unexpected reply {reply.TAG!r}"
    history = list(state.history)
    return {"time": time.time(), "error": error, "nodes": nodes, "requests": requests,
            "series": series(history, config.window_s), "latest": latest(history),
            "window_s": config.window_s}


def unavailable_errors(state) -> tuple[type[Exception], ...]:
    """What `state.call` raises when the engine cannot answer: the state's ServerUnavailable
    where it has one, and the HTTP layer's ApiError (HttpState.call raises a 503 one)."""
    own = getattr(state, "ServerUnavailable", None)
    return (ApiError,) if own is None else (own, ApiError)


# ---- the radix table ----
def decoder(tokenizer) -> Decode:
    """Token ids to text with `tokenizer`; without one (or for ids it cannot decode), the ids."""
    def as_ids(ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))

    if tokenizer is None:
        return as_ids

    def decode(ids: Sequence[int]) -> str:
        try:
            return tokenizer.decode(list(ids))
        except (ValueError, TypeError, IndexError, OverflowError):
            return as_ids(ids)
    return decode


def path_runs(node: dict[str, Any], parent: tuple[Runs, int] | None) -> Runs:
    """The known tokens of the path to `node`, given its parent's (runs, depth), or None when the
    parent is the root (`node["parent"]` None) or not listed."""
    own = tuple(node["tokens"])
    if parent is None:
        if node["parent"] is not None:  # an ancestor is missing: the prefix is unknown
            return ((), own)
        runs, depth = ((),), 0
    else:
        runs, depth = parent
    path = runs[:-1] + (runs[-1] + own,)
    cut = len(own) < node["depth"] - depth  # the engine sent only the edge's first tokens
    return path + ((),) if cut else path


def text_of(runs: Runs, decode: Decode) -> str:
    return ELLIPSIS.join(decode(run) if run else "" for run in runs)


def visible(text: str) -> str:
    """`text` on one line: newlines and tabs as visible marks."""
    return text.replace("\r\n", "↵").replace("\n", "↵").replace("\r", "↵").replace("\t", "→")


def head_cut(text: str, n: int) -> str:
    return text if len(text) <= n else ELLIPSIS + text[len(text) - n:]


def tail_cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + ELLIPSIS


def middle_cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n // 2] + ELLIPSIS + text[len(text) - n // 2:]


def node_rows(nodes: list[dict[str, Any]], decode: Decode, config: DashboardConfig) -> list[dict[str, Any]]:
    """The CacheTree's nodes (parents before children) as table rows: the node's figures, its
    `level` in the listed forest, its path `text`, and for display the end of its parent's text
    (`prefix`) and the start of its own (`edge`)."""
    known: dict[Any, tuple[Runs, int, str, int]] = {}  # id -> (runs, depth, text, level)
    rows = []
    for node in nodes:
        parent = known.get(node["parent"])
        runs = path_runs(node, parent[:2] if parent else None)
        text = visible(text_of(runs, decode))
        above = parent[2] if parent else ("" if node["parent"] is None else ELLIPSIS)
        edge = text[len(above):] if text.startswith(above) else visible(decode(node["tokens"]))
        level = parent[3] + 1 if parent else 0
        known[node["id"]] = (runs, node["depth"], text, level)
        rows.append({"id": node["id"], "parent": node["parent"], "level": level,
                     "text": middle_cut(text, config.text_chars),
                     "prefix": head_cut(above, config.prefix_chars), "edge": tail_cut(edge, config.edge_chars),
                     "edge_tokens": len(node["tokens"]), "depth": node["depth"], "size": node["size"],
                     "hits": node["hits"], "locks": node["locks"], "replica": node.get("replica")})
    return rows


# ---- the requests table ----
def request_rows(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests, running ones first, named by the client's id where the gateway gave it."""
    order = {state: i for i, state in enumerate(STATES)}
    rows = [{"rid": r.get("client_rid") or r["rid"], "engine_rid": r["rid"], "state": r["state"],
             "program": r.get("program"), "prompt_tokens": r["prompt_tokens"],
             "cached_tokens": r["cached_tokens"], "output_tokens": r["output_tokens"],
             "replica": r.get("replica")}
            for r in requests]
    return sorted(rows, key=lambda r: order.get(r["state"], len(STATES)))  # stable: keeps queue order


# ---- the charts ----
def series(history: list[tuple[float, dict[str, Any]]], window_s: float) -> dict[str, list]:
    """The samples of the last `window_s` seconds as chart series: `t` (seconds before the latest
    sample, <= 0), `hit_rate` (the engine's cache hit rate since it started), `tokens_per_s`
    (generated tokens per second between a sample and the one before it; None for the first
    sample and across a counter reset) and `kv_usage` (the share of the KV pool that requests hold,
    cached prefixes no request reads counted free: /metrics' kv_cache_usage_perc)."""
    if not history:
        return {"t": [], "hit_rate": [], "tokens_per_s": [], "kv_usage": []}
    end = history[-1][0]
    start = next(i for i, (t, _) in enumerate(history) if t >= end - window_s)
    out: dict[str, list] = {"t": [], "hit_rate": [], "tokens_per_s": [], "kv_usage": []}
    for i in range(start, len(history)):
        t, stats = history[i]
        out["t"].append(round(t - end, 3))
        out["hit_rate"].append(_number(stats.get("cache_hit_rate")))
        out["kv_usage"].append(_number(stats.get("kv_usage")))
        out["tokens_per_s"].append(rate(history[i - 1], history[i]) if i else None)
    return out


def rate(before: tuple[float, dict[str, Any]], after: tuple[float, dict[str, Any]]) -> float | None:
    """Generated tokens per second between two samples; None when unknown."""
    (t0, s0), (t1, s1) = before, after
    g0, g1 = _number(s0.get("generated_tokens")), _number(s1.get("generated_tokens"))
    if g0 is None or g1 is None or t1 <= t0 or g1 < g0:
        return None
    return (g1 - g0) / (t1 - t0)


def latest(history: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """The latest sample's figures, with the latest windowed tokens/s; {} before any sample."""
    if not history:
        return {}
    t, stats = history[-1]
    keys = ("cache_hit_rate", "tokens_per_s", "kv_usage", "pool_usage", "running", "queue", "grammar_queue")
    out: dict[str, Any] = {key: _number(stats.get(key)) for key in keys}
    out["time"] = t
    out["recent_tokens_per_s"] = rate(history[-2], history[-1]) if len(history) > 1 else None
    return out


def _number(value: Any) -> float | int | None:
    """`value` if it is a finite number (JSON has no NaN), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None
