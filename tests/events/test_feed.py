"""`EventFeed`: every manager's events carry parent hashes and token ids, per KV cache group.

- One full group: the same random workload on a `PagedKVManager` and on a one-group `HybridKVManager`
  gives the same events, batch after batch, parents and tokens included, and every parent is exact (the
  block's key chains from it through its tokens), also for blocks whose sequence ended before the poll.
- Two groups (full + sliding): every group's log holds exactly the keys that group's blocks hold in the
  prefix index, and every key a log holds chains from its recorded parent through its recorded tokens
  (parents are only sent while that group holds them).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core import PagedKVManager
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.group_keys import split_key
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.core.prefix import root_key, sha256_key
from pagedkv.events import GPU, BlockRemoved, BlockStored, EventFeed, EventLog, external_hash

BS = 4


def steps(rng: np.random.Generator, managers: list, num_steps: int):  # type: ignore[no-untyped-def]
    """The same operations on every manager: admissions of prompts sharing prefixes, decode, frees."""
    prefixes = [rng.integers(0, 50, size=int(rng.integers(BS, 5 * BS))).tolist() for _ in range(4)]
    live: list[list[int]] = []  # per live sequence: each manager's seq id
    for _ in range(num_steps):
        r = rng.random()
        if r < 0.4 or not live:
            prompt = prefixes[int(rng.integers(4))] + rng.integers(0, 50, size=int(rng.integers(1, 2 * BS))).tolist()
            adms = [m.admit(prompt) for m in managers]
            assert (adms[0] is None) == (adms[-1] is None)
            if adms[0] is not None:
                ids = [a.seq_id for a in adms]
                for m, s in zip(managers, ids):
                    m.mark_computed([s])
                live.append(ids)
        elif r < 0.8:
            toks = rng.integers(0, 50, size=len(live))
            ok = [m.append([ids[i] for ids in live], toks) for i, m in enumerate(managers)]
            assert len(set(ok)) == 1
            if ok[0]:
                for i, m in enumerate(managers):
                    m.mark_computed([ids[i] for ids in live])
        else:
            ids = live.pop(int(rng.integers(len(live))))
            for m, s in zip(managers, ids):
                m.free(s)
        for m in managers:
            m.check_invariants()
        yield
    for ids in live:
        for m, s in zip(managers, ids):
            m.free(s)
    yield


def flat(batch) -> list[tuple]:  # type: ignore[no-untyped-def]
    """A batch as comparable tuples (the timestamp and the trailing group_idx left out)."""
    out: list[tuple] = []
    for e in batch.events if batch is not None else ():
        if isinstance(e, BlockStored):
            out.append(("stored", tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.medium))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", tuple(e.block_hashes), e.medium))
        else:
            out.append((type(e).__name__,))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_group_events_equal_the_uniform_managers(seed: int) -> None:
    paged = PagedKVManager(24, BS, record_events=True)
    hybrid = HybridKVManager(24, BS, (KVGroupSpec(),), record_events=True)
    assert paged.num_blocks == hybrid.num_blocks
    paged_log, hybrid_log = EventLog(BS), EventLog(BS)
    paged_feed, hybrid_feed = EventFeed(paged, [paged_log]), EventFeed(hybrid, [hybrid_log])
    rng = np.random.default_rng(seed)
    stored = with_parent = removed = 0
    for _ in steps(rng, [paged, hybrid], 150):
        paged_feed.poll()
        hybrid_feed.poll()
        a, b = flat(paged_log.take_batch()), flat(hybrid_log.take_batch())
        assert b == a
        stored += sum(e[0] == "stored" for e in a)
        with_parent += sum(e[0] == "stored" and e[2] is not None for e in a)
        removed += sum(e[0] == "removed" for e in a)
        chains_ok(paged_log)
    assert stored > 20 and with_parent > 5 and removed > 5, (stored, with_parent, removed)
    assert paged_feed.orphans == hybrid_feed.orphans == 0


def chains_ok(log: EventLog, epoch: int = 0) -> int:
    """Every key the log holds chains from its recorded parent through its recorded tokens."""
    root = root_key(sha256_key, epoch, b"", b"")
    held = log.holds(GPU)
    for key in held:
        info = log.known(key)
        assert info is not None
        parent, tokens = info
        assert len(tokens) == BS
        data = np.asarray(tokens, dtype=np.int32).tobytes()
        assert sha256_key(root if parent is None else parent, data, b"") == key
    return len(held)


@pytest.mark.parametrize("seed", [0, 1])
def test_two_groups_carry_parent_and_tokens_per_group(seed: int) -> None:
    m = HybridKVManager(40, BS, (KVGroupSpec(), KVGroupSpec("sliding", 6)), record_events=True)
    logs = [EventLog(BS), EventLog(BS)]
    feed = EventFeed(m, logs)
    rng = np.random.default_rng(seed)
    held: list[set[int]] = [set(), set()]
    parents: list[int] = [0, 0]
    for _ in steps(rng, [m], 200):
        feed.poll()
        for g, log in enumerate(logs):
            batch = log.take_batch()
            for e in batch.events if batch is not None else ():
                if isinstance(e, BlockStored):
                    assert len(e.token_ids) == BS * len(e.block_hashes), "every block's tokens go out"
                    if e.parent_block_hash is not None:
                        assert e.parent_block_hash in held[g], "a parent this group does not hold"
                        parents[g] += 1
                    held[g].update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    held[g].difference_update(e.block_hashes)
        truth: list[set[int]] = [set(), set()]
        for key in m.index.all_keys():
            content, g = split_key(key)
            truth[g].add(external_hash(content))
        assert held == truth, "each group's events say what its blocks hold"
        for log in logs:
            chains_ok(log)
    assert parents[0] > 5 and parents[1] > 0, parents


@pytest.mark.parametrize("seed", [0, 1])
def test_one_group_resets_and_epochs_equal_the_uniform_managers(seed: int) -> None:
    """`reset()` and `bump_epoch()` are the one feed's: through a one-group hybrid manager they give the
    paged manager's events (one `AllBlocksCleared`, the older epoch's later removals swallowed), and
    `device_keys()` leaves out the keys that can no longer hit; bumping the manager's epoch behind the feed
    is refused by both. (Epochs are bumped with no sequence live: a live sequence's later blocks are keyed
    differently by the two managers after a bump, which is no feed's business.)"""
    paged = PagedKVManager(24, BS, record_events=True)
    hybrid = HybridKVManager(24, BS, (KVGroupSpec(),), record_events=True)
    paged_log, hybrid_log = EventLog(BS), EventLog(BS)
    feeds = [EventFeed(paged, [paged_log]), EventFeed(hybrid, [hybrid_log])]
    rng = np.random.default_rng(seed)
    swallowed = 0
    for round_ in range(3):
        for i, _ in enumerate(steps(rng, [paged, hybrid], 50)):
            if round_ == 0 and i == 25:
                assert feeds[0].reset() == feeds[1].reset() > 0
            stale = len(feeds[0]._stale)
            for feed in feeds:
                feed.poll()
            swallowed += stale - len(feeds[0]._stale)
            assert flat(hybrid_log.take_batch()) == flat(paged_log.take_batch())
            assert feeds[1].device_keys() == feeds[0].device_keys()
        assert feeds[0].bump_epoch() == feeds[1].bump_epoch() == round_ + 1
        assert feeds[0].device_keys() == feeds[1].device_keys() == set()
        assert flat(hybrid_log.take_batch()) == flat(paged_log.take_batch()) != []
        assert len(feeds[1]._stale) == len(feeds[0]._stale) > 0
    assert swallowed > 0
    for m, feed in zip((paged, hybrid), feeds):
        m.bump_epoch()
        with pytest.raises(InvalidArgumentError, match="epoch"):
            feed.poll()


def test_a_sequence_freed_before_the_poll_keeps_its_exact_parents() -> None:
    """Salted sequences admitted, computed and freed between two polls (no live row holds their blocks at
    the poll): the first one's blocks go out from no parent, and the next turn's new blocks name the last
    of them as their parent, with their tokens."""
    m = PagedKVManager(24, BS, record_events=True)
    log = EventLog(BS)
    feed = EventFeed(m, [log])
    first = list(range(3 * BS + 1))
    stored = []
    for prompt in (first, first[: 3 * BS] + list(range(100, 100 + 2 * BS + 1))):
        adm = m.admit(prompt, salt=b"tenant")
        assert adm is not None
        m.mark_computed([adm.seq_id])
        m.free(adm.seq_id)
        feed.poll()
        batch = log.take_batch()
        assert batch is not None
        stored += [e for e in batch.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [3, 2]
    assert stored[0].parent_block_hash is None and list(stored[0].token_ids) == first[: 3 * BS]
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert list(stored[1].token_ids) == list(range(100, 100 + 2 * BS))
    assert feed.orphans == 0
