"""The `stemma` command."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from stemma.cli_args import Parser, add_dataclass_args, collect
from stemma.engine_config import EngineConfig
from stemma.lang.escapes import unescape
from stemma.log import LEVELS, configure as configure_logging
from stemma.progress import elapsed, stage
from stemma.serve.launch import API_KEY_ENV, ServeConfig
from stemma.serve.ray_placement import RayPlacement
from stemma.serve.router import Routing
from stemma.serve.supervisor import Supervision
from stemma.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The commands sample greedily by default (temperature 0), unlike SamplingParams (1.0) and run():
# a command line is for trying a model, where the same input should give the same output.
_GENERATE_DEFAULTS = {"max_new_tokens": 64, "temperature": 0.0}
_SERVE_OWN_FLAGS = ("supervision", "routing", "ray")  # ServeConfig fields that are dataclasses with flags of their own


def _engine(ns):
    stage(logger, "loading %s", ns.model or "the default model (Gemma 3 270M)")
    from stemma.engine.engine import Engine
    return Engine(**collect(ns, EngineConfig))


def _logprob_lines(out, decode) -> list[str]:
    """One line per generated token: its text, its logprob, and the top alternatives if asked."""
    lines = []
    for i, token in enumerate(out.token_ids):
        line = f"  {decode([token])!r:>16} {out.logprobs[i]:9.4f}" if out.logprobs else f"  {decode([token])!r:>16}"
        if out.top_logprobs:
            line += "   top: " + ", ".join(f"{decode([t])!r} {lp:.3f}" for t, lp in out.top_logprobs[i])
        lines.append(line)
    return lines


def _print_outputs(prompt: str, outs: list, decode) -> None:
    """Each output after the prompt; several (--n) under a header each; logprobs when asked."""
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"--- output {i + 1} of {len(outs)} ({out.finish_reason}) ---")
        print(prompt + out.text)
        if out.logprobs or out.top_logprobs:
            columns = ["token", *(["logprob"] if out.logprobs else []),
                       *(["top alternatives"] if out.top_logprobs else [])]
            print(f"--- logprobs: {', '.join(columns)} ---")
            print("\n".join(_logprob_lines(out, decode)))


def cmd_generate(ns) -> int:
    params = SamplingParams.from_dict({**_GENERATE_DEFAULTS, **collect(ns, SamplingParams)})
    if ns.stream and (params.n != 1 or params.logprobs or params.top_logprobs):
        raise ValueError("--stream prints text as it comes: drop it for --n, --logprobs or "
                         "--top-logprobs")
    prompt = unescape(ns.prompt)
    engine = _engine(ns)
    load = elapsed()
    if ns.stream:
        sys.stdout.write(prompt)
        for delta in engine.stream(prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        outs = engine.generate(prompt, params)
        _print_outputs(prompt, outs if isinstance(outs, list) else [outs], engine.tokenizer.decode)
    stats = engine.stats()
    print(f"[model ready in {load:.1f}s | {stats['generated_tokens']} tokens at "
          f"{stats['tokens_per_s']:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_serve(ns) -> int:
    from stemma.serve.launch import serve
    supervision = Supervision(**collect(ns, Supervision))
    routing = Routing(**collect(ns, Routing))
    ray = RayPlacement(**collect(ns, RayPlacement))
    return serve(EngineConfig.from_kwargs(**collect(ns, EngineConfig)),
                 ServeConfig(**collect(ns, ServeConfig, _SERVE_OWN_FLAGS), supervision=supervision,
                             routing=routing, ray=ray),
                 ns.log_level)


_PROGRAM_DEFAULTS = {"max_new_tokens": 64, "temperature": 0.0}
_NOT_PROGRAM_DEFAULTS = ("n", "logprob_start", "logprobs", "top_logprobs")  # per call, not per program


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("backend")
    group.add_argument("--connect", metavar="ADDRESS",
                       help="run on the stemma server at ADDRESS instead: its ZeroMQ port "
                            "(tcp://host:port, ipc://path) or its HTTP port (http://host:port, "
                            "https://...)")
    group.add_argument("--api-key", metavar="KEY", default=None,
                       help="the key of a server started with --api-key (default: $STEMMA_API_KEY)")
    group.add_argument("--backend", choices=("embedded", "engine", "mock"), default="embedded",
                       help="embedded: a private runtime (engine and gateway processes, the "
                            "default); engine: the engine in this process; mock: a deterministic "
                            "fake model, for trying the language")
    add_dataclass_args(parser, SamplingParams, skip=_NOT_PROGRAM_DEFAULTS, shown_defaults=_PROGRAM_DEFAULTS)
    add_dataclass_args(parser, EngineConfig)


def _backend(ns):
    if ns.connect:
        from stemma.lang.backends.remote import RuntimeEndpoint
        return RuntimeEndpoint(ns.connect, api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None)
    if ns.backend == "mock":
        from stemma.lang.backends.mock import MockBackend
        return MockBackend()
    if ns.backend == "engine":
        from stemma.lang.backends.engine import EngineBackend
        return EngineBackend(**collect(ns, EngineConfig))
    from stemma.lang.backends.remote import EmbeddedBackend
    return EmbeddedBackend(**collect(ns, EngineConfig), log_level=ns.log_level)


def _sampling(ns) -> dict:
    return {**_PROGRAM_DEFAULTS, **collect(ns, SamplingParams, skip=_NOT_PROGRAM_DEFAULTS)}


def _parse_vars(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        if not eq or not name.isidentifier():
            raise ValueError(f"--var takes name=value, got {item!r}")
        out[name] = unescape(value)
    return out


def cmd_run(ns) -> int:
    from stemma.lang.errors import ProgramError
    from stemma.lang.stm import load
    try:
        program = load(ns.program)
        variables = _parse_vars(ns.var)
        program.bind((), variables)
    except (ProgramError, TypeError) as exc:
        print(f"stemma: error: {exc}", file=sys.stderr)
        return 2
    from stemma.client.core import ServerError
    backend = _backend(ns)
    last = "\n"
    try:
        state = program.run(backend=backend, sampling=_sampling(ns), stream=True, **variables)
        for delta in state.text_iter():
            sys.stdout.write(delta)
            sys.stdout.flush()
            last = delta or last
        if not last.endswith("\n"):
            sys.stdout.write("\n")
        for name, value in state.vars().items():
            print(f"[{name}] {value!r}", file=sys.stderr)
        print(f"[{state.usage()}]", file=sys.stderr)
    except (ProgramError, ConnectionError, ServerError) as exc:  # a server's refusal too
        if not last.endswith("\n"):
            sys.stdout.write("\n")  # the error on a line of its own, not after the partial text
            sys.stdout.flush()
        print(f"stemma: error: {exc}", file=sys.stderr)
        return 1
    finally:
        backend.close()
    return 0


def cmd_repl(ns) -> int:
    from stemma.lang.repl import run_repl
    return run_repl(lambda: _backend(ns), _sampling(ns), ns.history)


def cmd_tune(ns) -> int:
    from stemma.engine.tune_command import run_tune
    return run_tune(collect(ns, EngineConfig), show_only=ns.show, all_stores=ns.all)


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", choices=LEVELS, default=default,
                        help=f"what stemma logs to stderr, its server processes included "
                             f"(default: {default})")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="stemma", description="stemma: an LLM program runtime. Text you type "
                    "(prompts, --stop, --var, .stm programs, REPL inputs) reads backslash escapes "
                    "such as \\n as in Python strings; see the README.")
    from stemma import __version__
    parser.add_argument("--version", action="version", version=f"stemma {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", usage="%(prog)s [options] PROMPT", help="continue a prompt on the model (greedy by default)",
                         description="Continues PROMPT on the model and prints it with the "
                                     "continuation. Greedy by default (--temperature 0), unlike "
                                     "SamplingParams and program runs (1.0).")
    gen.add_argument("prompt", help="the text to continue; \\n and other escapes are read")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    add_dataclass_args(gen, SamplingParams, shown_defaults=_GENERATE_DEFAULTS)
    add_dataclass_args(gen, EngineConfig)
    _add_log_level(gen, "info")
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", usage="%(prog)s [options]", help="serve the model over HTTP (the OpenAI API) and ZeroMQ (stemma.connect)")
    add_dataclass_args(srv, ServeConfig, skip=_SERVE_OWN_FLAGS)
    add_dataclass_args(srv, Supervision)
    add_dataclass_args(srv, Routing)
    add_dataclass_args(srv, RayPlacement)
    add_dataclass_args(srv, EngineConfig)
    _add_log_level(srv, "info")
    srv.set_defaults(func=cmd_serve)
    run = sub.add_parser("run", usage="%(prog)s PROGRAM [--var NAME=VALUE ...] [options]", help="run a text program (.stm)",
                         description="Runs a text program and streams its text; the variables it "
                                     "generated follow on stderr. Sampling flags are the defaults "
                                     "of every gen in it.")
    run.add_argument("program", help="a .stm file")
    run.add_argument("--var", action="append", metavar="NAME=VALUE",
                     help="a variable of the program (repeatable); \\n and other escapes are read")
    _add_backend_args(run)
    _add_log_level(run, "warning")
    run.set_defaults(func=cmd_run)
    repl = sub.add_parser("repl", usage="%(prog)s [options]", help="an interactive prompt for plain prompts and text programs")
    repl.add_argument("--history", default=None,
                      help="history file (default: $STEMMA_HISTORY or ~/.stemma_history; '' for none)")
    _add_backend_args(repl)
    _add_log_level(repl, "warning")
    repl.set_defaults(func=cmd_repl)
    tune = sub.add_parser("tune", usage="%(prog)s [options]", help="measure (or show) the kernel dispatch table of a model on this machine",
                          description="Times every kernel each of the model's matrices can run at 1-128 "
                                      "rows and caches the fastest per row count (the engine does this "
                                      "at a model's first load). --show prints the cached table, "
                                      "measuring it only if there is none.")
    tune.add_argument("--show", action="store_true", help="print the cached table; measure only if absent")
    tune.add_argument("--all", action="store_true",
                      help="also time the stores the model does not use (int8/int4 for dense matrices, ...)")
    add_dataclass_args(tune, EngineConfig)
    _add_log_level(tune, "info")
    tune.set_defaults(func=cmd_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    configure_logging(ns.log_level)
    try:
        return ns.func(ns)
    except (ValueError, OSError) as exc:  # a bad option, a missing file, a folder for a file, ...
        print(f"stemma: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
