"""benchmarks/allocator_vs_peers.py: ratios only from one run's side-by-side rows, refused when schedules differ."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "allocator_vs_peers.py"


@pytest.fixture(scope="module")
def avp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("allocator_vs_peers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["allocator_vs_peers"] = module
    spec.loader.exec_module(module)
    return module


def row(us: float, steps: int = 4234, preemptions: int = 574) -> dict[str, float]:
    return {"us_per_token": us, "steps": steps, "preemptions": preemptions, "prefix_hit_rate": 0.12,
            "scheduled_tokens": 4_900_000}  # fmt: skip


def test_ratio_is_taken_within_each_repeat(avp: ModuleType) -> None:
    s = avp.summarize(
        "t", {"pagedkv": [row(0.1), row(0.2), row(0.1)], "peer": [row(0.3), row(0.5), row(0.4)]}
    )
    r = s["ratio_peer_over_pagedkv"]["peer"]
    assert r["runs"] == pytest.approx([3.0, 2.5, 4.0]) and r["median"] == pytest.approx(3.0)
    assert (r["min"], r["max"]) == pytest.approx((2.5, 4.0))
    assert s["systems"]["pagedkv"]["us_per_token"]["median"] == pytest.approx(0.1)


def test_ratio_refused_when_schedules_differ_by_more_than_2_percent(avp: ModuleType) -> None:
    ok = avp.summarize("t", {"pagedkv": [row(0.1, preemptions=578)], "peer": [row(0.3, preemptions=574)]})
    assert "median" in ok["ratio_peer_over_pagedkv"]["peer"], "0.7% more preemptions is the same schedule"
    s = avp.summarize("t", {"pagedkv": [row(0.1, steps=4234)], "peer": [row(0.3, steps=4400)]})
    assert "steps differ" in s["ratio_peer_over_pagedkv"]["peer"]["refused"]


def test_unavailable_peer_says_why(avp: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    peer = avp.PEERS[0]
    assert "no harness" in avp.peer_unavailable(peer, tmp_path, None)
    (tmp_path / peer.script).write_text("")
    assert "PEER_PY" in avp.peer_unavailable(peer, tmp_path, None)
    monkeypatch.delenv(peer.src_env, raising=False)
    assert peer.src_env in avp.peer_unavailable(peer, tmp_path, sys.executable)
    monkeypatch.setenv(peer.src_env, str(tmp_path))
    assert avp.peer_unavailable(peer, tmp_path, sys.executable) is None
