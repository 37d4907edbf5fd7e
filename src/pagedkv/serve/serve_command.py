"""`pagedkv serve`: an OpenAI-compatible server of one model on the pagedkv engine (FastAPI + uvicorn).

    pagedkv serve --model smollm2 --port 8000
    pagedkv serve --model ./my-model --kv-budget 256MiB --api-key secret --max-waiting 256

The engine flags are `pagedkv generate`'s (`pagedkv.engine.from_args`: the same names, defaults and
`EngineConfig`); the server adds `--host`, `--port`, `--served-model-name`, `--api-key`, `--max-waiting`,
`--max-body-bytes`, `--drain-timeout`. Arguments and the model source are checked before the weights load
(one line on stderr, exit 2). The first line on stderr says where it listens, the KV pool and
`max_model_len` (the longest request the pool and the model's positions can hold, as `/v1/models`
advertises it). SIGTERM or SIGINT (Ctrl-C) alike: the server stops accepting connections, says how many
requests are in flight (one line), lets them finish for up to `--drain-timeout` seconds (then aborts them),
stops the engine loop, says so (one line) and exits 0, with no traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from typing import Any

from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.engine.cli_args import int_at_least, nonnegative_float, positive_float, positive_int
from pagedkv.engine.from_args import add_engine_arguments, config_from_args

DEFAULT_PORT = 8000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2 (bundled), a local transformers folder or a .gguf file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int_at_least(0, 65535), default=DEFAULT_PORT, help="0 picks a free port (printed on stderr)")
    parser.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model)")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1")
    parser.add_argument("--max-waiting", type=positive_int, default=1024, help="requests waiting for a first token before 429")
    parser.add_argument("--max-body-bytes", type=int_at_least(1024), default=4 * 1024 * 1024, help="larger bodies get 413")
    parser.add_argument("--drain-timeout", type=nonnegative_float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    parser.add_argument(
        "--timeout-keep-alive", type=positive_int, default=30,
        help="seconds an idle keep-alive connection stays open (default 30: longer than clients' pools keep "
        "theirs, so a client never sends on a connection the server is closing)",
    )  # fmt: skip
    parser.add_argument(
        "--engine-process", action=argparse.BooleanOptionalAction, default=False,
        help="run the engine in a process of its own, beside the HTTP server's (default: on a thread of the "
        "server's process; docs/serving.md says what each costs)",
    )  # fmt: skip
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(parser)
    _add_replica_arguments(parser)


def _add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """`--replicas N` (N > 1) or `--ray-address` serve on Ray Serve (`pagedkv.serve.ray_cli`,
    docs/scale-out.md); one replica needs neither Ray nor Redis."""
    g = parser.add_argument_group("replicas on Ray Serve (docs/scale-out.md)")
    g.add_argument("--replicas", type=positive_int, default=1, help="engine replicas behind one ingress (>1: Ray Serve)")
    g.add_argument("--ray-address", default=None, help="join a Ray cluster (auto, ray://HOST:PORT); default: a local one")
    g.add_argument("--router", choices=("pagedkv", "prefix-affinity", "pow2"), default="pagedkv",
                   help="the replicas' request router")  # fmt: skip
    g.add_argument("--replica-cpus", type=positive_float, default=1.0, help="CPUs Ray reserves per replica")


def run(args: argparse.Namespace) -> int:
    if args.replicas > 1 or args.ray_address:
        from pagedkv.serve.ray_cli import run_replicas

        try:
            return run_replicas(args)
        except PagedKVError as err:
            print(f"pagedkv serve: {err}", file=sys.stderr)
            return 2
    try:
        server, sock, started = _build_server(args)
    except PagedKVError as err:
        print(f"pagedkv serve: {err}", file=sys.stderr)
        return 2
    # uvicorn re-raises the signal it caught once it has drained; this handler makes that harmless, so the
    # process ends with exit code 0 after a graceful SIGTERM or Ctrl-C (SIGINT's default handler would raise
    # KeyboardInterrupt then: a traceback and exit 130). A signal that arrives before uvicorn installs its own
    # handlers (after the start-up line) asks the server to exit as soon as it has started.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    print(started, file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0


def _build_server(args: argparse.Namespace) -> tuple[Any, socket.socket, str]:
    """Check the source, load the model, build the engine (in a process of its own with `--engine-process`),
    the app and the uvicorn server (not started), and bind its socket (so `--port 0` can say which port it
    got); with the start-up line to print."""
    import uvicorn

    from pagedkv.serve.app import build_app
    from pagedkv.serve.engine_client import EngineClient
    from pagedkv.serve.engine_setup import EngineFacts

    client: EngineClient
    facts: EngineFacts
    if args.engine_process:
        from pagedkv.serve.engine_process import ProcessEngine

        config_from_args(args)  # a bad flag fails here, before a process starts
        process_engine = ProcessEngine.spawn(args, max_waiting=args.max_waiting)
        client, facts = process_engine, process_engine.facts
        where = f"the engine in process {process_engine.pid}"
    else:
        from pagedkv.serve.async_engine import AsyncEngine, launch
        from pagedkv.serve.engine_setup import load_engine

        def build() -> tuple[AsyncEngine, EngineFacts]:
            engine, facts = load_engine(args)
            return AsyncEngine(engine, max_waiting=args.max_waiting), facts

        client, facts = launch(build)  # loaded on the thread that steps it (one OpenMP team)
        where = "the engine on a thread"
    try:
        app = build_app(
            client,
            model_name=args.served_model_name or args.model,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
        )
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        uv_config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.drain_timeout,
            timeout_keep_alive=args.timeout_keep_alive,
            access_log=args.log_level in ("info", "debug"),
        )  # fmt: skip
        server = _draining_server(uvicorn.Server, client)(uv_config)
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
        except OSError as err:
            sock.close()
            raise InvalidArgumentError(f"cannot listen on {args.host}:{args.port}: {err.strerror}") from None
    except BaseException:
        client.shutdown(1.0)
        raise
    return server, sock, _start_line(args, facts, sock.getsockname()[1], app.state.context.max_model_len, where)


def _start_line(args: argparse.Namespace, facts: Any, port: int, max_model_len: int, where: str) -> str:
    """The start-up line: where it listens, the KV pool, `max_model_len`, the weights, threads and engine."""
    limit = facts.max_positions
    positions = "" if limit is None else f" of the model's {limit} positions"
    return (
        f"pagedkv serve: {args.served_model_name or args.model} on http://{args.host}:{port} "
        f"({_kv_phrase(args.kv_budget, facts.kv_budget_bytes)}{facts.num_blocks} KV blocks of "
        f"{facts.block_size} tokens: max_model_len {max_model_len}{positions}, {facts.weights}, "
        f"{facts.threads} torch thread{'s' if facts.threads != 1 else ''}, {where})"
    )


def _kv_phrase(asked: int | None, used: int) -> str:
    """The KV budget said back for the start-up line: what `--kv-budget` asked for, in bytes and binary
    units, and what the blocks take (a whole number of blocks fits under it)."""
    if asked is None:
        return ""
    return f"--kv-budget {asked:,} bytes = {asked / 2**20:,.1f} MiB, {used / 2**20:,.1f} MiB in "


def _draining_server(base: Any, async_engine: Any) -> Any:
    """uvicorn's `Server` (`base`, imported lazily) that says on stderr when it starts draining (how many
    requests are in flight) and when it has stopped; nothing in between."""

    class DrainingServer(base):  # type: ignore[misc,valid-type]
        async def shutdown(self, sockets: Any = None) -> None:
            start = time.monotonic()
            in_flight = async_engine.stats().num_in_flight
            print(f"pagedkv serve: draining {in_flight} request{'s' if in_flight != 1 else ''} in flight "
                  f"(at most {self.config.timeout_graceful_shutdown:g} s)", file=sys.stderr, flush=True)  # fmt: skip
            await super().shutdown(sockets)
            print(f"pagedkv serve: stopped after draining for {time.monotonic() - start:.1f} s", file=sys.stderr,
                  flush=True)  # fmt: skip

    return DrainingServer
