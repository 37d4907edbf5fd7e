"""A private redis-server for a test (unix socket in a temp folder, never :6379), shared by the tier tests'
fixtures and the Ray replicas' module fixture.

Where `redis-server` is missing the test is skipped with one line, unless `PAGEDKV_REQUIRE_REDIS=1` (set by
.ci/run), which turns the skip into a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from pagedkv.tiers.redis_server import RedisServer, RedisUnavailableError, redis_server_path


def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """Yields a started server and stops it after (a fixture's body: `yield from private_redis(...)`)."""
    required = os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1"
    if redis_server_path() is None:
        if required:
            pytest.fail("PAGEDKV_REQUIRE_REDIS=1 but redis-server is not installed")
        pytest.skip("redis-server is not installed (set PAGEDKV_REQUIRE_REDIS=1 to fail instead)")
    server = RedisServer(folder=tmp_path_factory.mktemp("redis"))
    try:
        server.start()
    except RedisUnavailableError as err:
        if required:
            pytest.fail(str(err))
        pytest.skip(str(err))
    try:
        yield server
    finally:
        server.stop()
