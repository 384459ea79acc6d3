"""The `stemma` command."""
from __future__ import annotations

import argparse
import sys
import time

from stemma.cli_args import add_dataclass_args, collect
from stemma.runtime.engine_config import EngineConfig
from stemma.runtime.server import ServeConfig
from stemma.sampling_params import SamplingParams

_GENERATE_DEFAULTS = {"max_new_tokens": 64, "temperature": 0.0}


def _engine(ns):
    from stemma.runtime.engine import Engine
    return Engine(**collect(ns, EngineConfig))


def cmd_generate(ns) -> int:
    params = SamplingParams.from_dict({**_GENERATE_DEFAULTS, **collect(ns, SamplingParams)})
    t0 = time.perf_counter()
    engine = _engine(ns)
    load = time.perf_counter() - t0
    if ns.stream:
        sys.stdout.write(ns.prompt)
        for delta in engine.stream(ns.prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        outs = engine.generate(ns.prompt, params)
        for out in outs if isinstance(outs, list) else [outs]:
            print(ns.prompt + out.text)
    stats = engine.stats()
    print(f"[model ready in {load:.1f}s | {stats['generated_tokens']} tokens at "
          f"{stats['tokens_per_s']:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_serve(ns) -> int:
    from stemma.runtime.server import serve
    return serve(EngineConfig.from_kwargs(**collect(ns, EngineConfig)),
                 ServeConfig(**collect(ns, ServeConfig)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stemma", description="stemma: an LLM program runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="continue a prompt on the model (greedy by default)")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    add_dataclass_args(gen, SamplingParams, shown_defaults=_GENERATE_DEFAULTS)
    add_dataclass_args(gen, EngineConfig)
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="serve the model to clients over ZeroMQ (stemma.connect)")
    add_dataclass_args(srv, ServeConfig)
    add_dataclass_args(srv, EngineConfig)
    srv.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as exc:
        print(f"stemma: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
