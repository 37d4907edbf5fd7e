"""`pagedkv serve --replicas N`: the model's replicas on Ray Serve (docs/scale-out.md).

    pagedkv serve --model smollm2 --replicas 2 --remote-url redis://10.0.0.5:6379/0
    pagedkv serve --model ./m --replicas 8 --ray-address auto      # an existing cluster

Every `pagedkv serve` flag means what it means there (the engine flags are `pagedkv generate`'s); the
driver builds the `EngineConfig` from them once, and each replica loads the model itself and builds its
engine from that config with KV events on. `--replicas 1` runs on Ray only with `--ray-address`; without
it, it is one process with neither Ray nor Redis. Ctrl-C or SIGTERM drains as the single server does (the
streams in flight finish, for up to `--drain-timeout` seconds), removes the application and, if this
process started the local Ray cluster, stops it; the exit code is 0.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import sys
import threading
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from pagedkv.engine.from_args import config_from_args
from pagedkv.serve.ray_app import ReplicaSet, check_port, ray_cluster, serve_app

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig


def replica_engine(config: EngineConfig, remote_url: str | None, *, model: str, dtype: str, threads: int | None,
                   replicas: int) -> Any:
    """A replica's engine (run in the replica's process) from the config the driver built once from the
    flags, with this replica's store URL and KV events on; its torch threads: `threads`, or this machine's
    cores shared evenly by the `replicas`."""
    from pagedkv.engine.cli_args import use_threads
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.hf.cpu_linear import resolve_dtype
    from pagedkv.hf.loading import check_source, load_tokenizer, load_weights, set_progress_bars

    config = dataclasses.replace(config, remote_url=remote_url, kv_events=True)
    source = check_source(model)
    set_progress_bars(False)
    use_threads(threads, share=replicas)
    tokenizer = load_tokenizer(source)
    return Engine(load_weights(source, dtype=resolve_dtype(dtype), tokenizer=tokenizer), tokenizer, config)


def run_replicas(args: Any) -> int:
    """Deploy `args.replicas` replicas of the model `args` describe and serve until Ctrl-C or SIGTERM, then
    drain: the app is deleted (each replica finishes what is in flight, for up to `--drain-timeout`
    seconds), Serve and the Ray cluster this process started stop, and the exit code is 0."""
    from pagedkv.hf.loading import check_source

    config = config_from_args(args)  # bad engine flags: one line before Ray starts
    check_source(args.model)
    engine = functools.partial(replica_engine, config, model=args.model, dtype=args.dtype, threads=args.threads,
                               replicas=args.replicas)  # fmt: skip
    spec = ReplicaSet(
        replicas=args.replicas, engine=engine,
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
