"""`FleetLoad` under random placements, completions, prefills and reports, against a shadow of what it should
count; its own invariants after every operation."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv.router import FleetLoad, PrefixMatch
from pagedkv.router.load import placement

REPLICAS = ("a", "b", "c")
HASHES = st.lists(st.integers(0, 5), min_size=0, max_size=4, unique=True)


class FleetLoadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.load = FleetLoad()
        self.placed: dict[str, tuple[str, int, tuple[int, ...], bool]] = {}  # rid -> replica, blocks, hashes, done
        self.others: dict[str, int] = {}
        self.on_gpu: set[tuple[int, str]] = set()

    @rule(rid=st.sampled_from([f"q{i}" for i in range(6)]), replica=st.sampled_from(REPLICAS), hashes=HASHES,
          held=st.integers(0, 4))  # fmt: skip
    def place(self, rid: str, replica: str, hashes: list[int], held: int) -> None:
        entry = placement(replica, hashes, PrefixMatch(gpu=min(held, len(hashes))))
        self.load.place(rid, entry)
        self.placed[rid] = (replica, entry.blocks, tuple(hashes), entry.blocks == 0)

    @rule(rid=st.sampled_from([f"q{i}" for i in range(6)]))
    def release(self, rid: str) -> None:
        self.load.release(rid)
        self.placed.pop(rid, None)

    @rule(h=st.integers(0, 5), replica=st.sampled_from(REPLICAS))
    def computed(self, h: int, replica: str) -> None:
        self.on_gpu.add((h, replica))
        self.load.prefills_done(lambda x, r: (x, r) in self.on_gpu)
        for rid, (r, blocks, hashes, done) in self.placed.items():
            if not done and hashes and (hashes[-1], r) in self.on_gpu:
                self.placed[rid] = (r, blocks, hashes, True)

    @rule(replica=st.sampled_from(REPLICAS), n=st.integers(0, 8))
    def report(self, replica: str, n: int) -> None:
        self.load.report(replica, n)
        self.others[replica] = max(0, n - sum(1 for r, *_ in self.placed.values() if r == replica))

    @rule(replica=st.sampled_from(REPLICAS))
    def forget(self, replica: str) -> None:
        self.load.forget(replica)
        self.placed = {k: v for k, v in self.placed.items() if v[0] != replica}
        self.others.pop(replica, None)

    @invariant()
    def counts_what_it_was_told(self) -> None:
        self.load.check_invariants()
        for replica in REPLICAS:
            mine = [v for v in self.placed.values() if v[0] == replica]
            work = sum(1.0 if done else blocks + 1.0 for _, blocks, _, done in mine)
            assert self.load.requests(replica) == len(mine) + self.others.get(replica, 0)
            assert self.load.load(replica) == work + self.others.get(replica, 0)
            # blocks on their way: the leading run of a probe's hashes that a request still prefilling there has
            probe = list(range(6))
            arriving = {h for _, _, hashes, done in mine if not done for h in hashes}
            want = next((i for i, h in enumerate(probe) if h not in arriving), len(probe))
            assert self.load.match(replica, PrefixMatch(), probe).pending == want


TestFleetLoad = FleetLoadMachine.TestCase
TestFleetLoad.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
