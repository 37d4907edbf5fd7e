"""`EventStreams`' periodic check: a round trip to every replica that delivered nothing since the last one,
none to a replica whose events keep coming (its next batch shows any loss)."""

from __future__ import annotations

import time

from pagedkv import events as ev
from pagedkv.events.publisher import ZmqEventPublisher
from pagedkv.router.event_streams import EventStreams

BS = 4


def batch(hashes: list[int]) -> ev.EventBatch:
    return ev.EventBatch(0.0, [ev.BlockStored(hashes, None, [], BS, None, ev.GPU)], 0)


def count_syncs(streams: EventStreams, name: str, synced: list[str]) -> None:
    sub = streams.subscriber(name)
    real = sub.sync

    def sync() -> list[tuple[int, ev.EventBatch]]:
        synced.append(name)
        return real()

    sub.sync = sync  # type: ignore[method-assign]


def test_the_periodic_check_syncs_only_the_silent_streams(tmp_path) -> None:
    now = [0.0]
    pubs = {n: ZmqEventPublisher(f"ipc://{tmp_path}/{n}.pub", f"ipc://{tmp_path}/{n}.replay") for n in "ab"}
    streams = EventStreams(sync_interval_s=1.0, clock=lambda: now[0])
    synced: list[str] = []
    try:
        for n, p in pubs.items():
            streams.add(n, p.endpoint, p.replay_endpoint)
            count_syncs(streams, n, synced)
        streams.check()  # an explicit check syncs every stream
        assert sorted(synced) == ["a", "b"]
        deadline = time.monotonic() + 10
        h = 1000
        while not streams.index.media(h, "a"):  # a's events arrive (published again until the SUB has joined)
            assert time.monotonic() < deadline, "a's events did not arrive"
            h += 1
            pubs["a"].publish(batch([h]))
            time.sleep(0.02)
            streams.poll()
        synced.clear()
        now[0] += 1.0
        streams.poll()  # due: b said nothing since the last check, a did
        assert synced == ["b"]
        now[0] += 1.0
        streams.poll()  # a has been silent since: its turn
        assert sorted(synced) == ["a", "b", "b"]
        assert streams.index.media(h, "a") == {ev.GPU}
    finally:
        streams.close()
        for p in pubs.values():
            p.close()
