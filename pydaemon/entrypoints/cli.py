"""The `pagedd` command line: `pagedd serve` (the daemon), `pagedd generate` (a client) and
`pagedd info | status | health` (operator queries of a running daemon)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys

from pydaemon import __version__


def _serve(args: argparse.Namespace) -> int:
    from pydaemon.entrypoints.daemon.app import serve
    from pydaemon.entrypoints.daemon.settings import resolve

    try:
        engine_kwargs, options, log_level = resolve(args)
    except ValueError as e:
        print(f"pagedd serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from pydaemon.config.engine import EngineConfig
    from pydaemon.entrypoints.daemon.flag_names import with_flag_names

    try:
        config = EngineConfig(**engine_kwargs)
    except (TypeError, ValueError) as e:
        print(f"pagedd serve: {with_flag_names(str(e))}", file=sys.stderr)
        return 2

    def launch_engine_core():
        from pydaemon.engine.mp_client import MPEngineClient

        return MPEngineClient.launch(config)  # the engine core runs in its own process

    log = logging.getLogger("pydaemon.entrypoints.cli")
    log.info("pagedd %s: starting %s (%s)", __version__, config.model, _changed_settings(config))
    log.debug("engine settings: %s", config)

    try:
        return asyncio.run(serve(launch_engine_core, options))
    except OSError as e:
        logging.getLogger("pydaemon.entrypoints.cli").error("cannot serve: %s", e)
        return 1


def _changed_settings(config) -> str:
    """The engine settings that differ from the defaults, as flags (the whole config is a
    DEBUG line: the first line a user sees says what was asked, not forty defaults)."""
    from dataclasses import fields

    from pydaemon.config.engine import EngineConfig

    defaults = EngineConfig()
    changed = [
        f"--{f.name.replace('_', '-')} {getattr(config, f.name)}"
        for f in fields(config)
        if f.name != "model" and getattr(config, f.name) != getattr(defaults, f.name)
    ]
    return ", ".join(changed) if changed else "default settings"


def _generate(args: argparse.Namespace) -> int:
    from pydaemon.entrypoints.grpc.client import run_generate

    return run_generate(args)


def _admin(args: argparse.Namespace) -> int:
    from pydaemon.entrypoints.grpc.admin import run_admin

    return run_admin(args)


def build_parser() -> argparse.ArgumentParser:
    from pydaemon.entrypoints.daemon.settings import add_serve_flags
    from pydaemon.entrypoints.grpc.admin import add_admin_parsers
    from pydaemon.entrypoints.grpc.client import add_generate_flags

    parser = argparse.ArgumentParser(prog="pagedd", description="pagedd inference daemon")
    parser.add_argument("--version", action="version", version=f"pagedd {__version__}")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser(
        "serve", help="run the daemon (gRPC; --http-port adds the OpenAI HTTP API)"
    )
    add_serve_flags(serve)
    generate = sub.add_parser("generate", help="stream a completion from a running daemon")
    add_generate_flags(generate)
    add_admin_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe can be caught, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader closed the pipe (`pagedd info | head`): stop quietly. Python flushes
        # stdout again at exit; point it at /dev/null so that flush cannot fail too.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "generate":
        return _generate(args)
    if args.command in ("info", "status", "health"):
        return _admin(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
