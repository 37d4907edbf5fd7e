"""`pagedkv serve --replicas N`: the model's replicas on Ray Serve (docs/scale-out.md).

    pagedkv serve --model smollm2 --replicas 2 --remote-url redis://10.0.0.5:6379/0
    pagedkv serve --model ./m --replicas 8 --ray-address auto      # an existing cluster

Every `pagedkv serve` flag means what it means there (the engine flags are `pagedkv generate`'s); each replica
loads the model itself and builds its engine from the same flags with KV events on. `--replicas 1` runs on
Ray only with `--ray-address`; without it, it is one process with neither Ray nor Redis. Ctrl-C or SIGTERM
drains as the single server does (the streams in flight finish, for up to `--drain-timeout` seconds), removes
the application and, if this process started the local Ray cluster, stops it; the exit code is 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import signal
import sys
import threading
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

from pagedkv.serve.ray_app import ReplicaSet, check_port, ray_cluster, serve_app


def engine_from_args(args: dict[str, Any], remote_url: str | None) -> Any:
    """A replica's engine from `pagedkv serve`'s flags (run in the replica's process), with KV events on;
    its torch threads: `--threads`, or this machine's cores shared evenly by the replicas."""
    from pagedkv.engine.cli_args import use_threads
    from pagedkv.engine.commands import _engine_config
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.hf.loading import check_source, load_tokenizer, load_weights, set_progress_bars

    ns = argparse.Namespace(**{**args, "remote_url": remote_url})
    config = dataclasses.replace(_engine_config(ns), kv_events=True)
    source = check_source(ns.model)
    set_progress_bars(False)
    use_threads(ns.threads, share=ns.replicas)
    tokenizer = load_tokenizer(source)
    from pagedkv.hf.cpu_linear import resolve_dtype

    return Engine(load_weights(source, dtype=resolve_dtype(ns.dtype), tokenizer=tokenizer), tokenizer, config)


def run_replicas(args: Any) -> int:
    """Deploy `args.replicas` replicas of the model `args` describe and serve until Ctrl-C or SIGTERM, then
    drain: the app is deleted (each replica finishes what is in flight, for up to `--drain-timeout`
    seconds), Serve and the Ray cluster this process started stop, and the exit code is 0."""
    from pagedkv.engine.commands import _engine_config
    from pagedkv.hf.loading import check_source

    _engine_config(args)  # bad engine flags: one line before Ray starts
    check_source(args.model)
    spec = ReplicaSet(
        replicas=args.replicas, engine=functools.partial(engine_from_args, dict(vars(args))),
        remote_url=args.remote_url, router=args.router, model_name=args.served_model_name or args.model,
        api_key=args.api_key, num_cpus=args.replica_cpus, drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
    )  # fmt: skip
    if args.ray_address is None:
        check_port(args.host, args.port)  # in use: one line, before Ray starts
    if spec.remote_url is None and spec.replicas > 1:
        print(f"pagedkv serve: warning: without --remote-url the {spec.replicas} replicas will not share KV "
              "(each computes the prefixes it has not seen itself)", file=sys.stderr, flush=True)  # fmt: skip
    stop = threading.Event()

    def on_sigterm(*_: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    with ray_cluster(args.ray_address, host=args.host, log_level=spec.log_level):
        # ray.init put its own handler in (it exits at once, without draining, and its core worker aborts)
        signal.signal(signal.SIGTERM, on_sigterm)
        with serve_app(spec, host=args.host, port=args.port, app_name="pagedkv") as app:
            print(f"pagedkv serve: {spec.replicas} replicas of {spec.model_name} on {app.url} (router {spec.router})",
                  file=sys.stderr, flush=True)  # fmt: skip
            with suppress(KeyboardInterrupt):
                stop.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`pagedkv serve` under another name: its flags, `--replicas` included (kept for older scripts)."""
    from pagedkv.engine.cli_args import OneLineParser
    from pagedkv.serve import serve_command

    parser = OneLineParser(prog="python -m pagedkv.serve.ray_cli", description="pagedkv replicas on Ray Serve")
    serve_command.add_arguments(parser)
    return serve_command.run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
