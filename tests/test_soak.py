"""The soak benchmark's one-minute version, on a tiny ByteLevel llama (so constrained requests
run): 32 mixed clients over ZeroMQ and HTTP, and the verdict must hold (no request lost, no
unexpected fate, no greedy mismatch, no constraint violation, RSS growth after warm-up under 5%
for the engine and the gateway, descriptors back, the KV pool whole).

Nothing is tolerated: every request gets its answer or an error, so the whole verdict must hold."""
import json
import subprocess
import sys
from pathlib import Path

from tests.bytelevel_tokenizer import build_tiny_bytelevel

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--dtype", "float32", "--attention-backend", "torch", "--max-context", "256",
         "--kv-pool-tokens", "8192", "--request-timeout", "30"]  # a tiny model answers in seconds


def test_one_minute_soak_on_a_tiny_model(tmp_path):
    folder = build_tiny_bytelevel(tmp_path / "model")
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "benchmarks/soak.py", "--minutes", "1", "--model", str(folder),
                           *FLAGS, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    figures = json.loads(out.read_text())
    v = figures["verdict"]
    assert proc.returncode == (0 if v["ok"] else 1), proc.stderr[-3000:]
    assert v["requests"] > 200, proc.stdout  # the mix really ran
    kinds = {(f["kind"], f["front"]) for f in figures["fates"]}
    assert {("constrained", "http"), ("disconnect", "zmq"), ("abort", "zmq"), ("openai_bad", "http"),
            ("past_context", "zmq"), ("sampled_n2", "http")} <= kinds, kinds
    lost = [(f["kind"], f["front"]) for f in figures["fates"] if f["fate"] == "lost"]
    assert not lost, proc.stdout
    assert v["unexpected"] == 0 and v["mismatches"] == 0 and v["violations"] == 0, proc.stdout
    assert v["pool_whole"] and v["fds_back"] and v["rss_measured"], proc.stdout
    assert all(g < 0.05 for g in v["rss_growth"].values()), proc.stdout
    assert v["ok"], proc.stdout
