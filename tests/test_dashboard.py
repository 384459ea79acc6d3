"""The cache dashboard (stemma.serve.http.dashboard): its data and page over FastAPI's TestClient,
then the page in a real headless Chromium, polling a live engine, and on a real `stemma serve`.

The first tests mount the router on a small app whose `state` stands in for the server's
HttpState: its `call` answers through the real engine loop (`EngineLoop.handle` and the codec)
on an in-process tiny llama with a word-level tokenizer, and adds the gateway's `program` and
`client_rid` keys."""
import html.parser
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import zmq
from fastapi import FastAPI, Header, HTTPException
from fastapi.testclient import TestClient

import stemma
from stemma import SamplingParams
from stemma import protocol as P
from stemma.engine.process import EngineLoop
from stemma.serve.http.dashboard import (ELLIPSIS, DashboardConfig, dashboard_router, decoder,
                                         node_rows, request_rows, series)
from stemma.serve.http.errors import unavailable
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer
from tests.served import HttpServed, free_port

SHARED = "ka lo mi nu pe ri so tu vé zo"        # a prefix every request shares
OWN = {"summarize": "日 kaka kalo", "classify": "kami kanu", "translate": "kape"}
SHORT = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_new_tokens=1500, ignore_eos=True)
CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("dashboard_llama"))))


@pytest.fixture
def engine(folder):
    return stemma.Engine(folder, dtype="float32", attention_backend="torch", kv_pool_tokens=4096,
                         max_running_requests=2, speculative="none")  # one token per step


class Outputs:
    def __init__(self):
        self.frames = []

    def send(self, frame):
        self.frames.append(frame)


class FakeState:
    """The HttpState interface the dashboard uses, over an in-process engine. `lock` is held
    while the engine is read, so a thread may step it meanwhile under the same lock."""

    class ServerUnavailable(Exception):
        pass

    def __init__(self, engine, key=None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.history = []
        self.programs = {}              # engine rid -> program
        self.lock = threading.Lock()
        self.sent = []
        self.reply = None               # when set: the reply to every call
        self.raises = None              # when set: what every call raises
        self._rids = itertools.count()
        self.auth = bearer(key)

    def new_rid(self):
        return f"dash-{next(self._rids)}"

    async def call(self, msg):
        self.sent.append(msg)
        if self.raises is not None:
            raise self.raises
        if self.reply is not None:
            return self.reply
        outputs = Outputs()
        with self.lock:
            EngineLoop(self.engine, None, outputs).handle(P.decode(P.encode(msg)))
        (frame,) = outputs.frames
        reply = P.decode(frame)
        for r in reply.requests:  # what the gateway adds
            r["program"] = self.programs.get(r["rid"])
            r["client_rid"] = "client-" + r["rid"]
        return reply

    def sample(self, at=None):
        with self.lock:
            self.history.append((time.time() if at is None else at, self.engine.stats()))


def bearer(key):
    def auth(authorization: str | None = Header(None)):
        if key is not None and authorization != f"Bearer {key}":
            raise HTTPException(401, "wrong API key")
    auth.key = key
    return auth


def make_app(state):
    app = FastAPI()
    app.include_router(dashboard_router(state))
    return app


def run_shared(engine, state, own, params, rid):
    """Submits SHARED + own under `rid`, named by the program `rid` in the requests table."""
    reqs = engine.submit(f"{SHARED} {own}", params, rid=rid)
    for req in reqs:
        state.programs[req.rid] = rid
    return reqs


# ---- the data, over TestClient ----
def test_page_is_one_self_contained_document(engine):
    client = TestClient(make_app(FakeState(engine)))
    res = client.get("/dashboard")
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/html")
    page = res.text
    for element_id in ("radix-table", "chart-hit-rate", "chart-tokens", "chart-kv", "requests-table",
                       "data-updated", "status"):
        assert f'id="{element_id}"' in page
    assert re.findall(r"https?://[^\s\"']+", page) == ["http://www.w3.org/2000/svg"]  # a namespace, not fetched
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(", page)
    assert "innerHTML" not in page  # user text goes in as textContent only


def test_data_shows_the_tree_the_requests_and_the_series(engine):
    state = FakeState(engine)
    for program in OWN:
        engine.generate(f"{SHARED} {OWN[program]}", SHORT)
    running = [run_shared(engine, state, OWN[p], LONG, p) for p in ("summarize", "classify")]
    waiting = run_shared(engine, state, "kape", LONG.replace(n=2), "translate")
    state.sample(at=1000.0)
    for _ in range(5):
        engine.step()
    state.sample(at=1002.0)
    client = TestClient(make_app(state))
    data = client.get("/dashboard/data").json()
    assert data["error"] is None and data["window_s"] == DashboardConfig().window_s
    assert isinstance(state.sent[-1], P.GetCacheTree) and state.sent[-1].limit == 20

    top = data["nodes"][0]
    assert (top["parent"], top["level"], top["prefix"]) == (None, 0, "")
    assert top["text"] == top["edge"] and top["text"].startswith(SHARED)
    # hits: the two later of the three finished requests and the two running ones found SHARED
    # cached at admission (the first computed it; the waiting pair is not admitted yet)
    assert top["hits"] == len(OWN) - 1 + len(running) and top["locks"] == 2
    assert top["size"] == engine.cache.tree.total_size
    by_id = {n["id"]: n for n in data["nodes"]}
    for program, own in OWN.items():  # a running prompt splits its node before its last token
        (row,) = [n for n in data["nodes"] if n["text"] == f"{SHARED} {own}"]
        assert row["level"] >= 1 and row["edge"] and own.endswith(row["edge"].strip())
        parent = by_id[row["parent"]]
        assert row["text"] == parent["text"] + row["edge"] and row["level"] == parent["level"] + 1
        # a prompt's first run computed it; a running rerun's cached prefix ends one token short
        assert row["hits"] == 0
        assert parent["hits"] == (1 if program in ("summarize", "classify") else top["hits"])
    (translate,) = [n for n in data["nodes"] if n["text"] == f"{SHARED} kape"]
    assert translate["parent"] == top["id"] and translate["edge"] == " kape"
    assert translate["prefix"] == SHARED  # shorter than prefix_chars: not cut
    children = {n["id"]: [c for c in data["nodes"] if c["parent"] == n["id"]] for n in data["nodes"]}
    assert all(n["size"] >= sum(c["size"] for c in children[n["id"]]) for n in data["nodes"])

    rows = data["requests"]
    assert [(r["rid"], r["state"], r["program"]) for r in rows] == [
        ("client-summarize", "running", "summarize"), ("client-classify", "running", "classify"),
        ("client-translate-0", "waiting", "translate"), ("client-translate-1", "waiting", "translate")]
    assert rows[0]["output_tokens"] == len(running[0][0].output_ids) == 5
    assert rows[0]["prompt_tokens"] == len(running[0][0].input_ids) and rows[0]["cached_tokens"] > 0
    assert rows[2]["engine_rid"] == waiting[0].rid == "translate-0"

    s = data["series"]
    generated = state.history[1][1]["generated_tokens"] - state.history[0][1]["generated_tokens"]
    assert s["t"] == [-2.0, 0.0] and s["tokens_per_s"] == [None, generated / 2.0] and generated == 10
    assert s["hit_rate"] == [h["cache_hit_rate"] for _, h in state.history]
    assert s["kv_usage"] == [h["kv_usage"] for _, h in state.history] and 0 < s["kv_usage"][1] < 1
    latest = data["latest"]
    # the requests' KV (as /metrics counts it) and the pool held, cached prefixes included
    assert latest["kv_usage"] == state.history[-1][1]["kv_usage"] <= latest["pool_usage"]
    assert (latest["running"], latest["queue"], latest["recent_tokens_per_s"]) == (2, 2, 5.0)
    for req in [*running[0], *running[1], *waiting]:
        engine.abort(req.rid)


def test_the_limit_goes_to_the_engine(engine):
    state = FakeState(engine)
    engine.generate(f"{SHARED} kaka", SHORT)
    engine.generate(f"{SHARED} kalo", SHORT)
    client = TestClient(make_app(state))
    assert len(client.get("/dashboard/data?limit=1").json()["nodes"]) == 1
    assert state.sent[-1].limit == 1
    assert client.get("/dashboard/data?limit=0").status_code == 422


def test_an_unavailable_engine_leaves_the_tables_empty_but_keeps_the_charts(engine):
    state = FakeState(engine)
    state.history = [(10.0, {"cache_hit_rate": 0.5, "generated_tokens": 0, "pool_usage": 0.25}),
                     (11.0, {"cache_hit_rate": 0.5, "generated_tokens": 7, "pool_usage": 0.5})]
    state.raises = state.ServerUnavailable("the gateway is gone")
    client = TestClient(make_app(state))
    data = client.get("/dashboard/data").json()
    assert data["error"] == "the engine is unavailable: the gateway is gone"
    assert data["nodes"] == [] and data["requests"] == []
    assert data["series"]["tokens_per_s"] == [None, 7.0]
    state.raises = unavailable("the model is still loading")  # what HttpState.call raises
    assert client.get("/dashboard/data").json()["error"] == "the engine is unavailable: the model is still loading"
    state.raises = None
    state.reply = P.ErrorMsg(rid="x", code=P.SHUTTING_DOWN, message="the server is stopping")
    assert client.get("/dashboard/data").json()["error"] == "shutting_down: the server is stopping"


def test_the_page_is_open_and_the_data_needs_the_api_key(engine):
    state = FakeState(engine, key="k3y")
    client = TestClient(make_app(state))
    page = client.get("/dashboard")  # a browser opening the page sends no Bearer header
    assert page.status_code == 200 and page.text == client.get("/dashboard", headers={
        "Authorization": "Bearer k3y"}).text
    assert state.sent == []  # the page holds no data: the engine was not asked
    assert client.get("/dashboard/data").status_code == 401
    assert client.get("/dashboard/data", headers={"Authorization": "Bearer nope"}).status_code == 401
    data = client.get("/dashboard/data", headers={"Authorization": "Bearer k3y"})
    assert data.status_code == 200 and data.json()["error"] is None
    assert 'Authorization: "Bearer " + key' in page.text  # the page sends the key from #key=


# ---- the pieces ----
def node(id, parent, tokens, depth, size=1, hits=0, locks=0):
    return {"id": id, "parent": parent, "tokens": tokens, "depth": depth, "size": size, "hits": hits,
            "locks": locks}


def test_a_cut_edge_shows_an_ellipsis_where_its_tokens_are_missing():
    ids = decoder(None)
    rows = node_rows([node(0, None, [1, 2], 5), node(1, 0, [3], 6), node(2, 1, [4, 5], 8)], ids,
                     DashboardConfig())
    assert [r["text"] for r in rows] == [f"1 2{ELLIPSIS}", f"1 2{ELLIPSIS}3", f"1 2{ELLIPSIS}3 4 5"]
    assert [r["edge"] for r in rows] == [f"1 2{ELLIPSIS}", "3", " 4 5"]
    assert [r["level"] for r in rows] == [0, 1, 2]


def test_a_node_whose_parent_is_not_listed_has_an_unknown_prefix():
    (row,) = node_rows([node(7, 3, [4, 5], 9)], decoder(None), DashboardConfig())
    assert (row["text"], row["prefix"], row["edge"], row["level"]) == (f"{ELLIPSIS}4 5", ELLIPSIS, "4 5", 0)


def test_text_is_decoded_along_the_whole_path_and_kept_on_one_line():
    class Chars:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    config = DashboardConfig(prefix_chars=4, edge_chars=3, text_chars=6)
    rows = node_rows([node(0, None, [ord(c) for c in "ab\ncd"], 5), node(1, 0, [ord(c) for c in "efgh\t"], 10)],
                     decoder(Chars()), config)
    assert rows[0]["text"] == "ab↵cd" and rows[0]["edge"] == "ab↵" + ELLIPSIS
    assert rows[1]["prefix"] == ELLIPSIS + "b↵cd" and rows[1]["edge"] == "efg" + ELLIPSIS
    assert rows[1]["text"] == "ab↵" + ELLIPSIS + "gh→"


def test_a_tokenizer_that_cannot_decode_falls_back_to_ids():
    class Broken:
        def decode(self, ids):
            raise IndexError("out of range")

    assert decoder(Broken())([5, 6]) == "5 6"


def test_requests_are_listed_running_first_by_their_client_id():
    rows = request_rows([
        {"rid": "w", "state": "waiting", "prompt_tokens": 3, "output_tokens": 0, "cached_tokens": 0,
         "program": None, "client_rid": None},
        {"rid": "g-1", "state": "running", "prompt_tokens": 3, "output_tokens": 2, "cached_tokens": 2,
         "program": "p", "client_rid": "g"}])
    assert [(r["rid"], r["engine_rid"], r["state"], r["program"]) for r in rows] == [
        ("g", "g-1", "running", "p"), ("w", "w", "waiting", None)]


def test_series_keep_the_window_and_break_where_the_rate_is_unknown():
    history = [(t, {"generated_tokens": g, "cache_hit_rate": h, "kv_usage": 0.5, "pool_usage": 0.75})
               for t, g, h in [(0, 0, 0.0), (100, 50, 0.1), (101, 60, math.nan), (102, 5, 0.2), (104, 9, 0.2)]]
    s = series(history, window_s=4)
    assert s["t"] == [-4, -3, -2, 0]
    assert s["tokens_per_s"] == [0.5, 10.0, None, 2.0]  # the counter went back: the engine restarted
    assert s["hit_rate"] == [0.1, None, 0.2, 0.2]
    assert s["kv_usage"] == [0.5] * 4  # the requests' KV, not the pool held with the cache
    assert series([], 60) == {"t": [], "hit_rate": [], "tokens_per_s": [], "kv_usage": []}


# ---- the page in a real browser ----
class Browser:
    """Headless Chromium, one process per page load."""

    def __init__(self, profile: Path):
        self.profile = profile

    def run(self, url, *args, budget_ms=4000):
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", f"--user-data-dir={self.profile}", f"--virtual-time-budget={budget_ms}",
               *args, url]
        out = subprocess.run(cmd, capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
        return out.stdout.decode()

    def dom(self, url, budget_ms=4000):
        return Dom(self.run(url, "--dump-dom", budget_ms=budget_ms))

    def screenshot(self, url, path):
        self.run(url, f"--screenshot={path}", "--window-size=1280,900", "--hide-scrollbars")
        return path


class Element:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent, self.children = tag, dict(attrs), parent, []

    @property
    def text(self):
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    def find_all(self, tag=None, **attrs):
        for c in self.children:
            if isinstance(c, Element):
                if (tag is None or c.tag == tag) and all(c.attrs.get(k.replace("_", "-")) == v
                                                         for k, v in attrs.items()):
                    yield c
                yield from c.find_all(tag, **attrs)


class Dom(html.parser.HTMLParser):
    """A dumped DOM as a tree of Elements."""
    VOID = {"meta", "link", "br", "img", "input", "hr", "source"}

    def __init__(self, markup):
        super().__init__(convert_charrefs=True)
        self.root = self.at = Element("#root", {}, None)
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        element = Element(tag, attrs, self.at)
        self.at.children.append(element)
        if tag not in self.VOID:
            self.at = element

    def handle_startendtag(self, tag, attrs):
        self.at.children.append(Element(tag, attrs, self.at))

    def handle_endtag(self, tag):
        at = self.at
        while at is not self.root and at.tag != tag:
            at = at.parent
        if at is not self.root:
            self.at = at.parent

    def handle_data(self, data):
        self.at.children.append(data)

    def by_id(self, element_id):
        (found,) = self.root.find_all(id=element_id)
        return found


class Server:
    """uvicorn on a thread, serving `app`."""

    def __init__(self, app):
        import uvicorn
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}/dashboard"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


class Stepper:
    """Steps the engine on a thread, under the state's lock, and samples its stats as the
    server's history would (every `every` seconds)."""

    def __init__(self, state, every=0.25):
        self.state, self.every = state, every
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        next_sample = 0.0
        while not self.stopping.is_set():
            with self.state.lock:
                self.state.engine.step()
            if time.monotonic() >= next_sample:
                self.state.sample()
                next_sample = time.monotonic() + self.every
            time.sleep(0.02)

    def stop(self):
        self.stopping.set()
        self.thread.join(10)


@pytest.fixture
def live(engine, request):
    """The dashboard app on a real port, over an engine that keeps generating: two requests
    sharing SHARED run and one waits, after three shared-prefix requests have finished. Its API
    key is the fixture's param (indirect parametrization; None: no key)."""
    state = FakeState(engine, key=getattr(request, "param", None))
    for own in OWN.values():
        engine.generate(f"{SHARED} {own}", SHORT)
    reqs = [r for p in OWN for r in run_shared(engine, state, OWN[p], LONG, p)]
    stepper = Stepper(state)
    server = Server(make_app(state))
    deadline = time.monotonic() + 30
    while len(state.history) < 4:  # a few samples, so that the charts have lines
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield server, state
    server.stop()
    stepper.stop()
    for req in reqs:
        engine.abort(req.rid)


def number(text):
    return float(text.replace(",", ""))


def check_page(dom, *, programs, hits):
    """The page that a browser rendered from live data shows the shared prefix (with a hit count
    in `hits`, a collection of allowed values), the requests and three charts with lines."""
    assert dom.by_id("status").text == "live"
    assert float(dom.by_id("data-updated").attrs["data-updated"]) > time.time() - 600
    rows = list(dom.by_id("radix-table").find_all("tr", data_level="0"))
    assert rows, "the radix table is empty"
    top = rows[0]
    (text,) = top.find_all("td", **{"class": "text"})
    assert SHARED in text.text
    shown_hits = number(next(top.find_all("td", **{"class": "num hits"})).text)
    locks = number(next(top.find_all("td", **{"class": "num locks"})).text)
    assert shown_hits in hits and locks >= 1
    requests = list(dom.by_id("requests-table").find_all("tr", data_state="running"))
    shown = {next(r.find_all("td", **{"class": "program"})).text for r in requests}
    assert shown & set(programs), f"no program among the running requests: {shown}"
    for chart in ("chart-hit-rate", "chart-tokens", "chart-kv"):
        svg = dom.by_id(chart)
        (path,) = svg.find_all("path", **{"class": "line"})
        assert int(svg.attrs["data-points"]) >= 2 and "L" in path.attrs["d"], chart
    assert number(dom.by_id("chart-tokens-value").text) > 0
    assert all(dom.by_id(fig).text.endswith("%") for fig in ("fig-kv", "fig-pool"))


@needs_chromium
@pytest.mark.parametrize("live", [None, "k3y+/=&x"], indirect=True, ids=["open", "keyed"])
def test_chromium_renders_the_live_dashboard(live, tmp_path):
    server, state = live
    key = state.auth.key
    browser = Browser(tmp_path / "profile")
    if key is not None:  # without the key in the fragment, the page says how to give it
        bare = browser.dom(server.url, budget_ms=1500)
        assert bare.by_id("status").text.startswith("no data: HTTP 401: open the page as /dashboard#key=")
    dom = browser.dom(server.url if key is None else f"{server.url}#key={urllib.parse.quote(key, safe='')}")
    # SHARED was found cached by the two later finished requests and the two running ones
    check_page(dom, programs=OWN, hits={len(OWN) - 1 + 2})
    assert dom.by_id("fig-running").text == "2" and dom.by_id("fig-queue").text == "1"
    waiting = list(dom.by_id("requests-table").find_all("tr", data_state="waiting"))
    assert [next(r.find_all("td", **{"class": "program"})).text for r in waiting] == ["translate"]


@needs_chromium
@pytest.mark.slow
def test_chromium_screenshot_of_the_live_dashboard(live, tmp_path):
    server, _ = live
    path = Path(os.environ.get("STEMMA_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
    path.parent.mkdir(parents=True, exist_ok=True)
    Browser(tmp_path / "profile").screenshot(server.url, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    print(f"dashboard screenshot: {path}")


# ---- on a real `stemma serve` ----

def get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as res:
        return res.status, res.read()


class Dealer:
    """Raw protocol requests with a program name (frames: [api key, body])."""

    def __init__(self, zmq_port):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{zmq_port}")

    def send(self, msg):
        self.sock.send_multipart([b"", P.encode(msg)])

    def recv(self, timeout_s=60):
        assert self.sock.poll(timeout_s * 1000), "no reply from the server"
        return P.decode(self.sock.recv_multipart()[-1])

    def close(self):
        self.ctx.destroy(linger=0)


@needs_chromium
def test_chromium_renders_the_dashboard_of_a_real_server(folder, tmp_path):
    served = HttpServed(folder, engine=dict(max_running_requests=2), cwd=REPO)
    dealer = Dealer(served.zmq_port)
    try:
        dealer.send(P.GenerateReq(rid="warm", prompt=f"{SHARED} kaka", params=SHORT))
        while not isinstance(dealer.recv(), P.Finished):
            pass
        for program, own in OWN.items():
            dealer.send(P.GenerateReq(rid=f"live-{program}", prompt=f"{SHARED} {own}", params=LONG,
                                      stream=True, program=program))
        first = dealer.recv()
        assert isinstance(first, P.TokenChunk), first
        deadline = time.monotonic() + 60
        while True:  # the server samples its stats once a second: wait for lines to draw
            status, body = get(served.url + "/dashboard/data", timeout=10)
            data = json.loads(body)
            assert status == 200 and data["error"] is None
            if sum(v is not None for v in data["series"]["tokens_per_s"]) >= 2:
                break
            assert time.monotonic() < deadline, data["series"]
            time.sleep(0.5)
        dom = Browser(tmp_path / "profile").dom(served.url + "/dashboard")
        # SHARED was found cached by the two requests admitted first; the third waits (max 2
        # running) until one of those has generated its 1500 tokens
        check_page(dom, programs=OWN, hits={2, 3})
    finally:
        for program in OWN:
            dealer.send(P.Abort(rid=f"live-{program}"))
        dealer.close()
        served.stop()
