"""Setting up the remote tier (issue #20.5): a malformed URL is refused by `EngineConfig`; a store that
cannot be used (wrong password, no socket, a database past the server's count) is one line at start-up and
the tier is off (or fatal with `remote_required=True`); the per-call timeout is configurable; repeated
failures start a back-off instead of costing a timeout every step; a key of another Redis type under the
prefix is deleted like a corrupt value."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.tiny import tiny_model
from pagedkv.tiers.keys import store_key
from pagedkv.tiers.redis_server import RedisServer
from pagedkv.tiers.remote import RedisTier, TierUnavailableError
from pagedkv.tiers.store import TieredStore
from pagedkv.tiers.value import BlockLayout

LAYOUT = BlockLayout("bfloat16", (2, 2, 4, 2, 8))
FP = "00ff00ff00ff00ff"


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def rows(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, LAYOUT.nbytes), dtype=np.uint8)


@pytest.mark.parametrize(
    "url",
    ["redis://host:abc/0", "redis://host:99999/0", "unix://", "redis://host/zero", "redis://host/0?socket_timeout=zz",
     "unix:///tmp/r.sock?db=a", "http://host", "redis://[::1/0", "redis://[zz::1]:6379", "rediss://[::1",
     "redis://user:pw@[::1/0"],
)  # fmt: skip
def test_a_malformed_remote_url_is_refused_by_the_config(url: str) -> None:
    with pytest.raises(InvalidArgumentError, match="remote_url") as err:
        EngineConfig(num_blocks=8, remote_url=url)
    assert "\n" not in str(err.value) and "pw" not in str(err.value)  # one line, no password


@pytest.mark.parametrize("kwargs", [dict(remote_timeout_s=0), dict(remote_backoff_s=-1.0),
                                    dict(remote_timeout_s="2"), dict(remote_required=1)])  # fmt: skip
def test_bad_remote_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        EngineConfig(num_blocks=8, remote_url="redis://localhost:6379/0", **kwargs)


def engine_with(url: str, **kwargs: Any) -> Engine:
    return Engine(tiny_model("llama"), None, EngineConfig(num_blocks=12, block_size=4, remote_url=url, **kwargs))


def unusable_urls(server: RedisServer, tmp_path: Path) -> dict[str, tuple[str, str]]:
    raw = redis.Redis.from_url(server.url)
    raw.config_set("requirepass", "secret")
    return {
        "password": (f"unix://:badpw@{server.socket}", "authentication failed"),
        "no password": (server.url, "authentication failed"),
        "socket": (f"unix://{tmp_path}/absent.sock", "cannot connect"),
        "database": (f"unix://:secret@{server.socket}?db=99", "database number is past the server's count"),
    }


def test_an_unusable_store_is_one_line_at_start_up_and_the_tier_is_off(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for what, (url, why) in unusable_urls(redis_server, tmp_path).items():
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            engine = engine_with(url)
        assert engine.tiering is not None and engine.tiering.store.remote is None, what
        line = engine.tiering.inactive()["REMOTE"]
        assert why in line and "\n" not in line and "secret" not in line and "badpw" not in line, line
        assert [r.getMessage() for r in caplog.records] == [line]
        out = engine.generate([list(range(3, 20))], SamplingParams(max_new_tokens=2, ignore_eos=True))[0]
        assert len(out.output_token_ids) == 2  # serving goes on without the tier
        with pytest.raises(TierUnavailableError, match=why):
            engine_with(url, remote_required=True)
    good = engine_with(f"unix://:secret@{redis_server.socket}")
    assert good.tiering is not None and good.tiering.inactive() == {} and good.tiering.store.remote is not None
    good.close()


def test_the_per_call_timeout_is_configurable(redis_url: str) -> None:
    engine = engine_with(redis_url, remote_timeout_s=0.25)
    remote = engine.tiering.store.remote  # type: ignore[union-attr]
    assert remote.client.connection_pool.connection_kwargs["socket_timeout"] == 0.25
    engine.close()


def test_repeated_failures_start_a_back_off(redis_server: RedisServer) -> None:
    now = [0.0]
    tier = RedisTier(redis_server.url, LAYOUT, FP, timeout_s=0.2, backoff_s=30.0, clock=lambda: now[0])
    assert tier.put([k(0)], rows(1)).num_stored == 1
    redis_server.stop()
    for _ in range(3):
        assert tier.lookup([k(0)]) == 0
    assert tier.round_trips == 4 and tier.failures["error"] == 3 and tier.status() is not None
    for _ in range(10):  # skipped: no round trip, no timeout
        assert tier.lookup([k(0)]) == 0 and tier.put([k(1)], rows(1)).num_stored == 0
    assert tier.round_trips == 4 and tier.failures["backoff"] == 20
    assert "3 failed calls in a row" in str(tier.status())
    assert "3 failed calls in a row" in TieredStore(LAYOUT, [], tier).inactive()["REMOTE"]  # what generate prints
    now[0] = 31.0  # the back-off is over: the next call tries again
    assert tier.lookup([k(0)]) == 0 and tier.round_trips == 5 and tier.status() is None


def test_a_key_of_another_redis_type_is_deleted_like_a_corrupt_value(redis_url: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    raw.hset(store_key(FP, k(0)), "field", "value")  # not a string: MGET would read nil forever
    tier = RedisTier(redis_url, LAYOUT, FP)
    assert tier.lookup([k(0)]) == 0 and tier.failures["wrong_type"] == 1
    assert raw.exists(store_key(FP, k(0))) == 0
    assert tier.put([k(0)], rows(1)).num_stored == 1 and tier.lookup([k(0)]) == 1


def test_a_disk_folder_that_cannot_hold_the_tier_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(InvalidArgumentError, match="the disk tier cannot create its file in"):
        Engine(tiny_model("llama"), None, EngineConfig(num_blocks=8, disk_path=str(blocker / "sub"), disk_bytes=1 << 20))
