"""Rules both random-operation machines share (`test_state_machine.py` for the paged manager,
`test_hybrid_machine.py` for the hybrid one): a subclass keeps its manager in `self.m` and each live
sequence's expected token ids in `self.tokens`; fork copies them, free and preempt drop them."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule


class SequenceRules(RuleBasedStateMachine):
    m: Any  # the manager under test
    tokens: dict[int, list[int]]  # seq id -> expected token ids

    def _live(self) -> list[int]:
        """Sequences on the device (not swapped out)."""
        return [s for s in self.tokens if not self.m.is_swapped(s)]

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self._live()))
        child = self.m.fork(s)
        self.tokens[child] = list(self.tokens[s])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        s = data.draw(st.sampled_from(sorted(self.tokens)))
        if preempt and not self.m.is_swapped(s):
            assert self.m.preempt(s) == len(self.tokens[s])
        else:
            self.m.free(s)
        del self.tokens[s]
