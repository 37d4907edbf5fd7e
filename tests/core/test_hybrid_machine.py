"""Random operation sequences against `HybridKVManager`, with a shadow of the KV each slot holds.

Beside the manager the test keeps what a model would have written: every computed token's (position,
token id) at its slot in each group, block copies and swaps applied as the manager hands them out. After
every step, every group must read, through its own table, exactly the sequence's own tokens at every
position a query at `num_computed` can still attend to (`first_needed(num_computed)` onward): prefix hits,
copy-on-write, swaps, rollback and release as the window passes are all checked by content, on top of
`check_invariants`. At the end, freeing everything leaves no block in use.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from machine_rules import SequenceRules

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.core.group import KVGroupSpec
from pagedkv.core.hybrid import HybridKVManager

BS = 4
PREFIXES = ([1] * 9, [2, 1] * 9, [1, 2, 3] * 6, [3] * 25)
GROUPS = (KVGroupSpec(), KVGroupSpec("sliding", 6), KVGroupSpec("chunked", 8), KVGroupSpec("sliding", 3))


class HybridMachine(SequenceRules):
    """Fork and free come from `machine_rules.SequenceRules`."""

    def __init__(self) -> None:
        super().__init__()
        self.m = HybridKVManager(36, BS, GROUPS, num_host_blocks=24, record_events=True)
        self.kv: dict[int, tuple[int, int]] = {}  # device slot -> (position, token id)
        self.host: dict[int, tuple[int, int]] = {}
        self.tokens: dict[int, list[int]] = {}

    def _copies(self) -> None:
        src, dst = self.m.take_copies()
        moved = {}
        for s, d in zip(src.tolist(), dst.tolist()):
            for o in range(BS):
                if s * BS + o in self.kv:
                    moved[d * BS + o] = self.kv[s * BS + o]
        self.kv.update(moved)

    @rule(p=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 3), max_size=9), chunk=st.sampled_from([None, 3, 8]))
    def admit(self, p: list[int], suffix: list[int], chunk: int | None) -> None:
        prompt = p + suffix
        before = self.m.snapshot()
        try:
            adm = self.m.admit(prompt, chunk_tokens=chunk)
        except CapacityError:
            assert self.m.snapshot() == before, "a refused admission changed state"
            return
        if adm is not None:
            self.tokens[adm.seq_id] = list(prompt)
            self._check_seq(adm.seq_id)  # what the hit served is the prompt's own KV

    @precondition(lambda self: self._live())
    @rule(data=st.data(), n=st.integers(1, 9))
    def compute(self, data: st.DataObject, n: int) -> None:
        s = data.draw(st.sampled_from(self._live()))
        c = self.m.num_computed_tokens(s)
        end = min(c + n, len(self.tokens[s]))
        if end == c or not self.m.reserve([s], [end]):
            return
        self._copies()
        for g in range(self.m.num_groups):
            for pos, slot in zip(range(c, end), self.m.slot_mapping([s], [c], [end], group=g).tolist()):
                self.kv[slot] = (pos, self.tokens[s][pos])
        self.m.mark_computed([s], [end])

    @precondition(lambda self: self._live())
    @rule(data=st.data(), n=st.integers(1, 9))
    def compute_batch(self, data: st.DataObject, n: int) -> None:
        """A step's chunks for several sequences at once, as the engine marks them: forks and prefix hits
        then pass shared blocks out of a window in the same call."""
        live = self._live()
        batch = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        starts = [self.m.num_computed_tokens(s) for s in batch]
        ends = [min(c + n, len(self.tokens[s])) for s, c in zip(batch, starts)]
        if not self.m.reserve(batch, ends):
            return
        self._copies()
        for s, c, end in zip(batch, starts, ends):
            for g in range(self.m.num_groups):
                for pos, slot in zip(range(c, end), self.m.slot_mapping([s], [c], [end], group=g).tolist()):
                    self.kv[slot] = (pos, self.tokens[s][pos])
        self.m.mark_computed(batch, ends)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), k=st.integers(1, 3), tok=st.integers(1, 3))
    def append(self, data: st.DataObject, k: int, tok: int) -> None:
        live = self._live()
        batch = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        before, need, free = self.m.snapshot(), self.m.num_blocks_to_append(batch, k), self.m.num_free_blocks
        ok = self.m.append(batch, [[tok] * k for _ in batch], num_tokens=k)
        assert ok == (need <= free), f"append said {ok} with {need} needed, {free} free"
        if ok:
            for s in batch:
                self.tokens[s] += [tok] * k
        else:
            assert self.m.snapshot() == before, "a refused append changed state"

    @precondition(lambda self: self._live())
    @rule(data=st.data(), n=st.integers(0, 6))
    def rollback(self, data: st.DataObject, n: int) -> None:
        s = data.draw(st.sampled_from(self._live()))
        before = self.m.snapshot()
        try:
            self.m.rollback(s, min(n, len(self.tokens[s])))
        except InvalidArgumentError:
            assert self.m.snapshot() == before, "a refused rollback changed state"
            return
        del self.tokens[s][len(self.tokens[s]) - min(n, len(self.tokens[s])) :]

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self._live()))
        plan = self.m.swap_out(s)
        if plan is not None:
            for d, h in zip(plan.src.tolist(), plan.dst.tolist()):
                for o in range(BS):
                    self.host[h * BS + o] = self.kv.get(d * BS + o, (-1, -1))

    @precondition(lambda self: any(self.m.is_swapped(s) for s in self.tokens))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from([s for s in self.tokens if self.m.is_swapped(s)]))
        plan = self.m.swap_in(s)
        if plan is not None:
            for h, d in zip(plan.src.tolist(), plan.dst.tolist()):
                for o in range(BS):
                    self.kv[d * BS + o] = self.host[h * BS + o]

    @rule()
    def reset(self) -> None:
        self.m.reset_prefix_cache()

    def _check_seq(self, s: int) -> None:
        c = self.m.num_computed_tokens(s)
        for g, spec in enumerate(self.m.groups):
            lo = spec.first_needed(c)
            if lo >= c:
                continue
            slots = self.m.slot_mapping([s], [lo], [c], group=g).tolist()
            got = [self.kv.get(slot) for slot in slots]
            want = [(p, self.tokens[s][p]) for p in range(lo, c)]
            assert got == want, f"group {g} ({spec.label()}) of seq {s} reads {got}, wants {want}"

    @invariant()
    def consistent(self) -> None:
        self.m.check_invariants()
        self._copies()  # the next forward would run them first
        for s in self._live():
            assert self.m.num_tokens(s) == len(self.tokens[s])
            self._check_seq(s)

    def teardown(self) -> None:
        for s in list(self.tokens):
            self.m.free(s)
        self.m.take_copies()
        self.m.check_invariants()
        assert self.m.num_used_blocks == 0, "blocks still in use after every sequence was freed"


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _machine_with(policy: str) -> type[HybridMachine]:
    """The same machine over a pool ordered by eviction policy `policy`."""

    class PolicyMachine(HybridMachine):
        def __init__(self) -> None:
            super().__init__()
            self.m = HybridKVManager(36, BS, GROUPS, num_host_blocks=24, record_events=True, eviction=policy)

    PolicyMachine.__name__ = f"HybridMachine_{policy}"
    return PolicyMachine


_POLICY_SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))
TestHybridMachineSLRU = _machine_with("slru").TestCase
TestHybridMachineSLRU.settings = _POLICY_SETTINGS
TestHybridMachineLFU = _machine_with("lfu").TestCase
TestHybridMachineLFU.settings = _POLICY_SETTINGS
TestHybridMachinePriority = _machine_with("priority").TestCase
TestHybridMachinePriority.settings = _POLICY_SETTINGS
TestHybridMachineCost = _machine_with("cost").TestCase
TestHybridMachineCost.settings = _POLICY_SETTINGS
