"""A private redis-server per test that asks for `redis_url` (or `redis_server`, to stop it early) (unix socket in a temp folder, never :6379).

Where `redis-server` is missing the test is skipped with one line, unless `PAGEDKV_REQUIRE_REDIS=1`
(set by .ci/run), which turns the skip into a failure.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_support import private_redis

from pagedkv.tiers.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from private_redis(tmp_path_factory)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
