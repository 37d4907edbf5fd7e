"""Random operation sequences against the paged manager, checking every invariant after every step.

A model of the expected token content of each live sequence is kept beside the manager: after any
sequence of admit / append / fork / rollback / free / preempt / pin / unpin / reset / epoch bump, the
block tokens the manager holds for each sequence must equal the model's, and once every sequence is
freed and every pin released, the pool holds nothing in use. Every prefix hit must serve blocks that hold
the prompt's own tokens.

The "family" rules drive what random batches rarely reach: a sequence forked into n > 1 children, every
member (or one) rolled back into the same shared, published block, then one batch in which all of them
(or some) write into it, possibly after some were swapped out and back. Before the rule "a block written
in place has no key", the last writer of such a batch kept the block published with changed content.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from machine_rules import SequenceRules

from pagedkv.core import BlockKeys, PagedKVManager, PinError, PinHandle

BS = 4
VOCAB = 3  # tiny vocabulary: prompts collide often, so prefix sharing is exercised


class ManagerMachine(SequenceRules):
    """Fork and free come from `machine_rules.SequenceRules`."""

    record_events = True  # with events off, evicted keys are dropped lazily: both paths are checked
    hash_fn = "sha256"
    native: bool | None = None  # the C hot path when built
    eviction = "lru"  # tests/core/test_eviction.py runs this machine under every other policy
    partial_reuse = False  # tests/core/test_partial_reuse.py runs it with partial-block reuse on

    def __init__(self) -> None:
        super().__init__()
        self.m = PagedKVManager(
            num_blocks=24, block_size=BS, num_host_blocks=8, record_events=self.record_events, hash_fn=self.hash_fn,
            native=self.native, eviction=self.eviction, partial_reuse=self.partial_reuse,
        )
        self.tokens: dict[int, list[int]] = {}  # seq id -> expected token ids
        self.keys: dict[int, BlockKeys] = {}
        self.pins: list[PinHandle] = []
        self.indexed: set[object] = set()  # keys the event stream says are cached

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14), salt=st.sampled_from([b"", b"t2"]))
    def admit(self, prompt: list[int], salt: bytes) -> None:
        keys = BlockKeys(salt)
        adm = self.m.admit(prompt, keys=keys)
        if adm is not None:
            assert adm.seq_id not in self.tokens, "a live handle was handed out twice"
            assert (self.partial_reuse or adm.num_cached_tokens % BS == 0) and adm.num_cached_tokens < len(prompt)
            cached = adm.num_cached_tokens
            slots = self.m.slot_mapping([adm.seq_id], [0], [cached])
            assert self.m.block_tokens.reshape(-1)[slots].tolist() == prompt[:cached], "a hit served other tokens"
            self.tokens[adm.seq_id] = list(prompt)
            self.keys[adm.seq_id] = keys

    @precondition(lambda self: self._live())
    @rule(data=st.data(), k=st.integers(1, 5))
    def append(self, data: st.DataObject, k: int) -> None:
        live = self._live()
        batch = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        new = data.draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k), min_size=len(batch), max_size=len(batch)))
        before = self.m.snapshot()
        need = self.m.num_blocks_to_append(batch, k)
        available = self.m.num_free_blocks
        ok = self.m.append(batch, np.array(new), num_tokens=k)
        assert ok == (need <= available), f"append answered {ok} with {need} needed and {available} available"
        if ok:
            for s, t in zip(batch, new):
                self.tokens[s].extend(t)
        else:
            assert self.m.snapshot() == before, "a refused append changed state"

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self._live()))
        lo = self.m.num_computed_tokens(s)
        n = data.draw(st.integers(lo, len(self.tokens[s])))
        self.m.mark_computed([s], [n])

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self._live()))
        n = data.draw(st.integers(0, len(self.tokens[s]) - 1))
        self.m.rollback(s, n)
        del self.tokens[s][len(self.tokens[s]) - n :]

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        self.m.swap_out(data.draw(st.sampled_from(self._live())))

    @precondition(lambda self: any(self.m.is_swapped(s) for s in self.tokens))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        self.m.swap_in(data.draw(st.sampled_from([s for s in self.tokens if self.m.is_swapped(s)])))

    @precondition(lambda self: self._live())
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork_family(self, data: st.DataObject, n: int) -> None:
        """n children of one sequence (parallel sampling)."""
        s = data.draw(st.sampled_from(self._live()))
        for _ in range(n):
            child = self.m.fork(s)
            self.tokens[child] = list(self.tokens[s])

    def _families(self) -> list[list[int]]:
        """Live sequences grouped by the block they end in (the holders of a shared last block)."""
        groups: dict[int, list[int]] = {}
        for s in self._live():
            if self.tokens[s]:
                groups.setdefault(self.m.block_ids(s)[(len(self.tokens[s]) - 1) // BS], []).append(s)
        return [g for g in groups.values() if len(g) > 1]

    @precondition(lambda self: self._families())
    @rule(data=st.data(), everyone=st.booleans(), write=st.booleans(), swap=st.booleans())
    def rollback_into_shared(self, data: st.DataObject, everyone: bool, write: bool, swap: bool) -> None:
        """One or every holder of a shared block rolls back into it; then (maybe) all of them write at once,
        or (swap) one of them is swapped out while the others write, and comes back to write last."""
        family = data.draw(st.sampled_from(self._families()))
        n = data.draw(st.integers(1, BS - 1))
        if min(len(self.tokens[s]) for s in family) <= n:
            return
        members = family if everyone else family[:1]
        for s in members:
            self.m.rollback(s, n)
            del self.tokens[s][len(self.tokens[s]) - n :]
        if swap and self.m.swap_out(family[0]) is not None:
            for i, group in enumerate((family[1:], family[:1])):
                if i == 1 and self.m.swap_in(family[0]) is None:
                    break
                new = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(group), max_size=len(group)))
                if self.m.append(group, np.array(new)):
                    for s, t in zip(group, new):
                        self.tokens[s].append(t)
        elif write:
            new = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(family), max_size=len(family)))
            if self.m.append(family, np.array(new)):
                for s, t in zip(family, new):
                    self.tokens[s].append(t)
                self.m.mark_computed(family)

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=12))
    def pin(self, prompt: list[int]) -> None:
        cached = self.m.match_prefix(prompt + [0])
        try:
            self.pins.append(self.m.pin(prompt))
        except PinError:
            assert cached < BS, "pin refused a prefix that is cached"  # a pin holds full blocks only

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self) -> None:
        self.m.unpin(self.pins.pop())

    @rule()
    def take_copies(self) -> None:
        self.m.take_copies()

    @rule()
    def evict_all_cached(self) -> None:
        n = self.m.pool.num_available
        if n:
            self.m.pool.release(self.m.pool.allocate(n))  # take everything, give it back unkeyed

    @rule()
    def reset(self) -> None:
        self.m.reset_prefix_cache()

    @rule()
    def bump_epoch(self) -> None:
        self.m.bump_epoch()

    @invariant()
    def invariants_hold(self) -> None:
        self.m.check_invariants()
        if not self.record_events:
            return
        for e in self.m.take_events():
            if e.kind == "stored":
                assert e.key not in self.indexed, "stored twice without a removal"
                self.indexed.add(e.key)
            elif e.kind == "removed":
                self.indexed.remove(e.key)
            else:
                self.indexed.clear()
        live = set(self.m.index.index)
        assert self.indexed == live, "events disagree with the cache"

    @invariant()
    def content_matches_the_model(self) -> None:
        for s, expected in self.tokens.items():
            if self.m.is_swapped(s):
                continue
            assert self.m.num_tokens(s) == len(expected)
            slots = self.m.slot_mapping([s], [0], [len(expected)])
            assert self.m.block_tokens.reshape(-1)[slots].tolist() == expected, f"sequence {s} reads wrong tokens"

    def teardown(self) -> None:
        for s in list(self.tokens):
            self.m.free(s)
        self.m.take_copies()  # pending copies hold their blocks until handed out
        for handle in self.pins:
            self.m.unpin(handle)
        self.m.check_invariants()
        assert self.m.num_used_blocks == 0, "blocks leaked after every sequence and pin was released"


class LazyFastManagerMachine(ManagerMachine):
    record_events = False
    hash_fn = "fast"


class PythonHotPathMachine(ManagerMachine):
    """The pure-Python reference of the hot loops (what runs where the C extension is not built)."""

    native = False


_settings = settings(max_examples=400, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ManagerMachine.TestCase.settings = _settings
# The lazy/fast variant repeats ManagerMachine's rules with another key function and no event log; it is the
# slowest machine in the suite, so it draws half the examples (the million-op soak is the long exploration).
LazyFastManagerMachine.TestCase.settings = settings(_settings, max_examples=200)
PythonHotPathMachine.TestCase.settings = settings(_settings, max_examples=200)
TestManagerMachine = ManagerMachine.TestCase
TestPythonHotPathMachine = PythonHotPathMachine.TestCase
TestLazyFastManagerMachine = LazyFastManagerMachine.TestCase
