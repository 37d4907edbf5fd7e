"""`pagedkv serve --replicas N`'s driver (`pagedkv.serve.ray_cli`) without Ray: the engine config is built
once, from the flags, in the driver; every replica's factory carries that config (picklable, as Ray ships
it) and never parses the flags again."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import Any

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.cli_args import OneLineParser
from pagedkv.serve import ray_cli, serve_command


class _Deployed(Exception):
    """Raised by the fake `serve_app` with the spec it was given (ends `run_replicas` before it waits)."""


def _args(argv: list[str]) -> Any:
    parser = OneLineParser(prog="pagedkv serve")
    serve_command.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_driver_builds_the_engine_config_once_and_every_replica_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Any] = []

    def counting(args: Any) -> Any:
        built.append(real(args))
        return built[-1]

    @contextlib.contextmanager
    def no_ray(*_: Any, **__: Any) -> Iterator[bool]:
        yield False

    def deploy(spec: Any, **_: Any) -> Any:
        raise _Deployed(spec)

    real = ray_cli.config_from_args
    monkeypatch.setattr(ray_cli, "config_from_args", counting)
    monkeypatch.setattr("pagedkv.hf.loading.check_source", lambda model: model)
    monkeypatch.setattr(ray_cli, "ray_cluster", no_ray)
    monkeypatch.setattr(ray_cli, "serve_app", deploy)
    monkeypatch.setattr(ray_cli, "check_port", lambda *_: None)
    args = _args(["--replicas", "3", "--num-blocks", "32", "--block-size", "8", "--remote-url", "redis://h:1/0",
                  "--threads", "1", "--speculative", "ngram:k=2"])  # fmt: skip
    with pytest.raises(_Deployed) as deployed:
        ray_cli.run_replicas(args)
    spec = deployed.value.args[0]
    assert len(built) == 1 and spec.replicas == 3 and spec.remote_url == "redis://h:1/0"
    shipped = pickle.loads(pickle.dumps(spec.engine))  # what each replica receives
    assert shipped.func is ray_cli.replica_engine and shipped.args == (built[0],)
    assert shipped.args[0].num_blocks == 32 and shipped.args[0].block_size == 8
    assert shipped.keywords == {"model": "smollm2", "dtype": "auto", "threads": 1, "replicas": 3}


def test_bad_engine_flags_are_one_line_before_ray_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_cli, "ray_cluster", lambda *_, **__: pytest.fail("Ray started"))
    args = _args(["--replicas", "2", "--num-blocks", "8", "--disk-bytes", "1GiB"])  # a disk tier without a path
    with pytest.raises(InvalidArgumentError):
        ray_cli.run_replicas(args)
