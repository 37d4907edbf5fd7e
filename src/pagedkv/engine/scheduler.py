"""The continuous-batching scheduler: one rule for prefill and decode, over any allocator.

Every running request has `num_computed_tokens` catching up to `num_tokens`. Each step spends a token
budget (`max_num_batched_tokens`) over the requests:

  1. swapped-out requests come back first, if the device has room;
  2. running requests that just sampled a token (decode) get a slot for it: one batched `append` for all
     of them. If that does not fit, preempt the least important running request (lowest priority, then
     latest arrival): by recompute (free its KV, requeue it with prompt + output) or by swap (move its
     KV to host memory), and retry;
  3. running requests still in prefill get their next chunk (chunked prefill);
  4. waiting requests are admitted, most important first then arrival order, while the allocator holds
     their prompt and the budget and `max_num_seqs` allow; each gets its first chunk. Head-of-line
     blocking is deliberate: a request that does not fit stops admission, so big requests do not starve.
     A step that preempted admits nothing (as vLLM does): admitting would only thrash. Admission also
     keeps free the blocks the running requests need to grow by `admission_lookahead` tokens (the growth
     reserve), so that new prompts do not take the blocks the running ones are about to need and force a
     preemption a few steps later; with nothing running nothing is reserved, so an idle engine always
     admits.
  5. with `hold_shared_prefix` (SGLang's in-batch prefix caching), a waiting request whose first uncached
     full block is one that a request admitted earlier in the same step computes is held back to the next
     step, where it finds that block published (see "Holding back a shared prefix" below).

Holding back a shared prefix: blocks are published when the step's forward has written them
(`mark_computed`), so two requests admitted in one step that share an uncached prefix both compute it.
While admitting, the scheduler keeps the content keys of the uncached full blocks that this step's
admissions complete (their `BlockKeys` after the admission's lookup: `keys[i + 1]` is block i's key). Before
admitting a request it asks the manager how many leading tokens would hit (`match_prefix`, a query); the key
of its first missing block is then in its own `BlockKeys`, and if that key is in the step's set the request
waits. A held request keeps its place in the queue and the requests behind it are still considered (SGLang
deprioritises such requests the same way; stopping there would hold a burst of 32 requests sharing 4 system
prompts to one request a step). Bounds: a request is held at most once per admission (the next step
admits it whatever the set holds), and a request is held only when another was admitted in the same step
(the set is empty otherwise), so the hold costs a request at most one step and never stalls the engine.
Two requests that share a prefix contain the same key chain up to their first difference, so a later
request's first missing key equals an earlier admission's first missing key exactly when the earlier one
computes that block: keeping the keys the admission's lookup produced suffices. Not covered: the block of
an earlier prompt's last token when it is full (its key is not computed at admission), and blocks a request
admitted in an earlier step is still computing over several chunks. Managers without `match_prefix` (the
contiguous one) hold nothing.

Without chunked prefill a new prompt runs in one step, so a prompt longer than `max_num_batched_tokens`
is rejected at admission, whatever the prefix cache holds (the answer must not depend on it). A request
preempted by recompute is re-run in budget-sized chunks even then: chunking is a policy for new prompts,
and an accepted request must never become unservable because it was preempted.

A request whose admission the allocator refuses as misuse (`InvalidArgumentError`, e.g. a token id the
allocator cannot store) ends with finish_reason "error" and the message; the step goes on without it, and
nothing was planned for it (the allocator's checks run before it changes any state).

Forked children (`fork`) count against `max_num_seqs` like any running request.

Speculative decoding (`num_lookahead_tokens` = k > 0): a decoding request may carry draft tokens
(`Request.draft_token_ids`, set by whoever proposes them). The decode phase first gives every decoding
request its one slot, then, with the budget left, slots for its drafts (at most k, and never past
`max_new_tokens`: the verified drafts and the token after them must fit). A request whose drafts do not
fit the pool this step decodes without them: speculation never preempts. Its chunk is the last token and
the drafts. `update` takes the verified tokens (the accepted drafts, then one more) and, before it marks
anything computed, rolls the rejected drafts back through the allocator's `rollback` (their blocks go back
to the pool, never published), so the prefix cache only ever sees verified tokens and the request is left
decoding (`num_computed_tokens == num_tokens - 1`). Admission's growth reserve counts k more tokens per
running request.

```
before:  [ computed ........ | last ]                       num_computed = num_tokens - 1
chunk:                       [ last | d0 d1 d2 d3 ]         1 + k slots appended this step
verify:  d0 d1 accepted, t drawn after d1
after:   [ computed ............... | d0 d1 ] t             d2 d3 rolled back; t is the new last token
```

The scheduler knows nothing about models: the engine runs the `SchedulerOutput` on one, the simulator
times it with a roofline model; both call `update` with the sampled tokens.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import CapacityError, InvalidArgumentError, InvariantError
from pagedkv.core.prefix import BlockKeys, Key
from pagedkv.core.protocol import BlockFill, BlockMoves, BlockSource, KVManager
from pagedkv.engine.request import FINISH_REASONS, Request, RequestStatus

_EMPTY = np.zeros(0, dtype=np.int64)


PreemptionMode = Literal["recompute", "swap"]


@runtime_checkable
class PrefixMatcher(Protocol):
    """A manager with a prefix cache answers this query (the paged and hybrid managers): how many leading
    tokens of `token_ids` an admission would take from the cache now. It leaves the keys of the blocks it
    looked at in `keys` (up to and including the first missing one)."""

    def match_prefix(self, token_ids: npt.ArrayLike, *, salt: bytes = b"", keys: BlockKeys | None = None) -> int: ...


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's settings: the one place they are declared, defaulted and validated. `EngineConfig`
    (`engine.scheduler`) and the simulator's `SimConfig` (`scheduler`) embed it.

    Defaults: up to `max_num_seqs=256` running requests and `max_num_batched_tokens=512` tokens computed per
    step (vLLM's budget when chunked prefill is on), with chunked prefill, preempting by recompute, no
    admission headroom and a growth reserve of 16 tokens.

    `admission_headroom` is the fraction of blocks that must be free (free or evictable) at the start of a
    step for it to admit a new request beyond the first one scheduled, transformers' `safety_margin` (whose
    default is 0.15).

    `hold_shared_prefix` (default on) holds a waiting request back one step when its first
    uncached block is one that a request admitted earlier in the same step computes, so that it hits that
    block instead of computing it again (SGLang's in-batch prefix caching; the module docstring has the
    rule and its bounds). It changes when a request starts, never what it generates.

    `admission_lookahead` is the growth reserve: a new request is admitted only if the blocks every running
    request (and each one admitted before it in the step) would take to grow by that many tokens, fewer
    where its `max_new_tokens` ends sooner, stay free afterwards. Counted by the allocator
    (`num_blocks_to_append`): one block per paged sequence at 16 tokens and block size 16, none for the
    contiguous allocator, whose growth is reserved at admission. 0 turns it off (greedy admission, as vLLM
    does). Admitting into the last free blocks only to preempt a request a few steps later re-runs its
    tokens; docs/engine.md has the measurements behind the default.

    Entry points that want another budget pass it explicitly: `pagedkv simulate` / `plan` model a serving
    deployment with `--max-num-batched-tokens 8192` and greedy admission (the simulator's `SIM_SCHEDULER`).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    admission_headroom: float = 0.0
    admission_lookahead: int = 16
    hold_shared_prefix: bool = True

    def __post_init__(self) -> None:
        for name, least in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("admission_lookahead", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise InvalidArgumentError(f"{name} must be an int >= {least}, got {value!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise InvalidArgumentError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if not isinstance(self.hold_shared_prefix, bool):
            raise InvalidArgumentError(f"hold_shared_prefix must be a bool, got {self.hold_shared_prefix!r}")
        h = self.admission_headroom
        if isinstance(h, bool) or not isinstance(h, int | float) or not 0.0 <= h < 1.0:
            raise InvalidArgumentError(f"admission_headroom must be a fraction in [0, 1), got {h!r}")


class ScheduledChunk(NamedTuple):
    """Compute KV for tokens [start, start + num_new_tokens) of `request` this step.

    A speculating decode chunk also carries the draft tokens that follow the request's last token: it
    covers that token and the drafts (`num_new_tokens == 1 + len(draft_token_ids)`), the forward scores
    each of its positions, and `update` keeps the verified ones (see "Speculative decoding")."""

    request: Request
    start: int
    num_new_tokens: int
    produces_token: bool  # the chunk reaches the request's last token: sample the next one
    draft_token_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens




@dataclass
class SchedulerOutput:
    """One step's plan. Apply the block moves before the forward pass, in this order: `swap_in` (host ->
    device), then `swap_out` (device -> host), then `copies` (copy-on-write), then `fills` (tier hits).
    Swap-ins are decided first: a swap-out may reuse host blocks a swap-in just released, and one request
    may come in and go out in the same step, so the other order would overwrite host KV before it is read.
    Swaps move only computed KV (a swapped request's blocks past its computed tokens hold nothing yet).

    One writer per device block (`check_writes`, run on every plan): two moves writing one block would
    leave whichever runs last, e.g. a swap-in's never-computed host block over a tier hit loaded into it."""

    scheduled: list[ScheduledChunk] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)  # could never fit the KV capacity
    swap_out: BlockMoves = field(default_factory=lambda: BlockMoves(_EMPTY, _EMPTY))
    swap_in: BlockMoves = field(default_factory=lambda: BlockMoves(_EMPTY, _EMPTY))
    copies: BlockMoves = field(default_factory=lambda: BlockMoves(_EMPTY, _EMPTY))
    fills: list[BlockFill] = field(default_factory=list)  # tier hits (`KVManager.fetch_blocks`)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def check_writes(self) -> None:
        """Every device block is written by at most one move of the plan. A block a swap-in writes and a
        swap-out then reads back to the host may be written again (the swap-out runs first). Raises
        `InvariantError` naming both writers."""
        if not (len(self.swap_in.dst) or len(self.copies.dst) or self.fills):
            return
        writer: dict[int, str] = {}

        def claim(blocks: npt.NDArray[np.int64], name: str) -> None:
            for block in blocks.tolist():
                if block in writer:
                    raise InvariantError(
                        f"scheduler: device block {block} is written twice before the forward, by {writer[block]} "
                        f"and by {name}; one step's block moves must not share a destination"
                    )
                writer[block] = name

        claim(self.swap_in.dst, "swap-in")
        for block in self.swap_out.src.tolist():  # read back to the host: free to be written again
            writer.pop(block, None)
        claim(self.copies.dst, "copy-on-write")
        for fill in self.fills:
            claim(fill.dst, "tier load")


class Scheduler:
    def __init__(
        self,
        manager: KVManager,
        config: SchedulerConfig | None = None,
        *,
        source: BlockSource | None = None,
        num_lookahead_tokens: int = 0,
    ) -> None:
        self.manager = manager
        self.config = config or SchedulerConfig()
        if isinstance(num_lookahead_tokens, bool) or not isinstance(num_lookahead_tokens, int) or num_lookahead_tokens < 0:
            raise InvalidArgumentError(f"num_lookahead_tokens must be an int >= 0, got {num_lookahead_tokens!r}")
        if num_lookahead_tokens and not hasattr(manager, "rollback"):
            raise InvalidArgumentError(f"{type(manager).__name__} cannot roll back draft tokens; speculate with the paged allocator")
        self.num_lookahead_tokens = num_lookahead_tokens  # speculative decoding's k (module docstring)
        self.source = source  # the tiers below the device: a chunk's leading full blocks may be fetched
        self._swapped_in: dict[str, BlockMoves] = {}  # swap-in moves of the step being planned, by request
        if self.config.preemption_mode == "swap" and not manager.supports_swap:
            raise InvalidArgumentError(f"{type(manager).__name__} cannot swap; use preemption_mode='recompute'")
        # heap of (-priority, arrival, order of adding, unique tie-break, request)
        self._waiting: list[tuple[int, float, int, int, Request]] = []
        self._order = itertools.count()
        self.running: list[Request] = []  # admission order
        self.swapped: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self._order_of: dict[str, int] = {}  # request id -> position in arrival order
        self.num_preemptions = 0
        self._inflight: dict[str, int] = {}  # request id -> end of its chunk in the step being run
        self._forked: list[Request] = []  # children forked during the step being run
        self._stalled = False  # a prefill chunk found no slots this step (hybrid managers, `_reserved`)
        # `hold_shared_prefix`: the query it needs (None: off, or a manager without a prefix cache), and the
        # requests held back since they were last admitted (never held twice in a row)
        self._matcher: PrefixMatcher | None = None
        if self.config.hold_shared_prefix and isinstance(manager, PrefixMatcher):
            self._matcher = manager
        self._held: set[str] = set()

    # --- queue ----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self._by_id:
            raise InvalidArgumentError(f"request id {request.request_id!r} is already queued or running")
        if request.status is not RequestStatus.WAITING:
            raise InvalidArgumentError(f"request {request.request_id!r} is {request.status.value}, not new")
        self._by_id[request.request_id] = request
        self._order_of[request.request_id] = next(self._order)
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        # A preempted request keeps its original place: it goes back ahead of everything that came after it.
        order = self._order_of[request.request_id]
        heapq.heappush(self._waiting, (-request.priority, request.arrival_time, order, next(self._order), request))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running or self.swapped)

    def get(self, request_id: str) -> Request:
        try:
            return self._by_id[request_id]
        except KeyError:
            raise InvalidArgumentError(f"no unfinished request {request_id!r}") from None

    # --- one step -------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Plan one step. `now` stamps the finish time of requests rejected in it (None: their arrival)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        swap_out: list[BlockMoves] = []
        # blocks free at the start of the step, for the admission headroom (0: always roomy)
        roomy = self.manager.num_free_blocks >= self.config.admission_headroom * self.manager.num_blocks
        # 1. swapped requests come back first
        self._swap_in_phase()
        # 2. decode: one slot for each running request's newest token, in one batched call
        budget = self._decode_phase(out, budget, swap_out, now)
        # 3. running requests still in prefill
        budget = self._prefill_phase(out, budget)
        # 4. admit waiting requests (not in a step that had to preempt: that would only thrash)
        self._admit_phase(out, budget, now, roomy)
        if self._stalled and not out.scheduled and len(self.running) > 1:
            self._preempt(self._victim(), out, swap_out)  # every prefill waits for slots: make room
        self._stalled = False
        out.num_batched_tokens = sum(c.num_new_tokens for c in out.scheduled)
        self._inflight = {c.request.request_id: c.end for c in out.scheduled}
        out.copies = self.manager.take_copies()
        if swap_out:
            out.swap_out = BlockMoves(np.concatenate([s.src for s in swap_out]), np.concatenate([s.dst for s in swap_out]))
        swap_in, self._swapped_in = list(self._swapped_in.values()), {}
        if swap_in:
            out.swap_in = BlockMoves(np.concatenate([s.src for s in swap_in]), np.concatenate([s.dst for s in swap_in]))
        out.check_writes()
        return out

    def _swap_in_phase(self) -> None:
        """Bring swapped requests back, oldest first, while a seat and device blocks are free. Their moves
        wait in `_swapped_in` until the plan is complete: a request whose KV the same step drops again
        (preempted by recompute, rejected) takes its moves with it, so its blocks have no dead writer."""
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            assert request.seq_id is not None, "scheduler: a swapped request without KV"
            plan = self.manager.swap_in(request.seq_id)
            if plan is None:
                break
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._swapped_in[request.request_id] = self._computed_only(plan, request)

    def _decode_phase(
        self, out: SchedulerOutput, budget: int, swap_out: list[BlockMoves], now: float | None
    ) -> int:
        """A slot for each decoding request's newest token, preempting (or rejecting a lone request that can
        never grow) until the batched append succeeds. Returns the budget left."""
        decode = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]
        decode = decode[:budget]
        while decode:
            # a request re-admitted with all but its last token cached already holds that slot:
            # compare slots held with tokens in one batched query, not one manager call per request
            all_ids = np.array([r.seq_id for r in decode], dtype=np.int64)
            short = self.manager.seq_lens(all_ids) < np.array([r.num_tokens for r in decode])
            if not short.any():
                break
            need = [r for r, s in zip(decode, short.tolist()) if s]
            seq_ids = all_ids[short]
            tokens = np.array([r.output_token_ids[-1] for r in need], dtype=np.int64)
            if self.manager.append(seq_ids, tokens):
                break
            victim = self._victim()
            if len(self.running) == 1:  # alone and still short of one slot: it can never grow
                self._finish(victim, "rejected", now=now, error=(
                    f"request needs more than the KV capacity ({self.manager.num_blocks} blocks of "
                    f"{self.manager.block_size} tokens) to grow past {victim.num_tokens - 1} tokens"
                ))  # fmt: skip
                out.rejected.append(victim)
            else:
                self._preempt(victim, out, swap_out)
            decode = [r for r in decode if r is not victim]
        budget -= len(decode)
        drafts = self._draft_slots(decode, budget) if self.num_lookahead_tokens else {}
        for r in decode:
            d = drafts.get(r.request_id, ())
            out.scheduled.append(ScheduledChunk(r, r.num_computed_tokens, 1 + len(d), True, d))
            budget -= len(d)
        return budget

    def _draft_slots(self, decode: list[Request], budget: int) -> dict[str, tuple[int, ...]]:
        """Slots for the decoding requests' draft tokens, in order while the budget lasts; each request's
        drafts are taken (cleared) whether they fit or not. One batched `append` per draft length; a group
        the pool cannot hold is retried one request at a time, and a request that still does not fit
        decodes without drafts this step (speculation never preempts)."""
        planned: dict[int, list[tuple[Request, list[int]]]] = {}
        for r in decode:
            d, r.draft_token_ids = r.draft_token_ids, []
            room = min(self.num_lookahead_tokens, r.max_new_tokens - len(r.output_token_ids) - 1, budget)
            if d and room > 0:
                d = d[:room]
                planned.setdefault(len(d), []).append((r, d))
                budget -= len(d)
        got: dict[str, tuple[int, ...]] = {}
        for n, group in planned.items():
            seq_ids = np.array([r.seq_id for r, _ in group], dtype=np.int64)
            tokens = np.array([d for _, d in group], dtype=np.int64)
            if self.manager.append(seq_ids, tokens, num_tokens=n):
                got.update((r.request_id, tuple(d)) for r, d in group)
                continue
            for (r, d), seq_id, row in zip(group, seq_ids, tokens):
                if len(group) > 1 and self.manager.append(seq_id[None], row[None], num_tokens=n):
                    got[r.request_id] = tuple(d)
        return got

    def _prefill_phase(self, out: SchedulerOutput, budget: int) -> int:
        """The next chunk of each running request still in prefill, within the budget. Returns what is left."""
        for r in self.running:
            if budget <= 0:
                break
            remaining = r.num_tokens - r.num_computed_tokens
            if remaining <= 1 and r.num_computed_tokens == r.num_tokens - 1:
                continue  # decode, handled above
            chunk = self._chunk(remaining, budget, r)
            if chunk and not self._reserved(r, chunk):
                self._stalled = True  # a windowed group had no room for the chunk's slots: next step
                continue
            if chunk:
                out.scheduled.append(self._planned(r, chunk, chunk == remaining, out))
                budget -= chunk
        return budget

    def _reserved(self, request: Request, chunk: int) -> bool:
        """Slots for the request's next chunk, where the manager gives them per chunk (`reserves_chunks`: a
        hybrid manager's windowed groups hold only the window and the chunk, `KVManager.reserve`); True
        otherwise."""
        if not self.manager.reserves_chunks:
            return True
        assert request.seq_id is not None, "scheduler: a running request without KV"
        end = np.array([request.num_computed_tokens + chunk], dtype=np.int64)
        return bool(self.manager.reserve(np.array([request.seq_id], dtype=np.int64), end))

    def _admit_phase(self, out: SchedulerOutput, budget: int, now: float | None, roomy: bool) -> None:
        """Admit waiting requests in priority order while the budget, a seat and blocks allow (below the
        admission headroom, only while nothing else is scheduled) and the growth reserve stays free; requests
        that can never be served are finished as rejected and the step goes on."""
        reserve = self._growth_reserve(self.running) if self._waiting else 0  # no query when none waits
        computing: set[Key] = set()  # keys of the uncached full blocks this step's admissions complete
        held: list[Request] = []  # held back this step: back into the queue, in their places, at the end
        while (
            self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
            and not self.swapped and not out.preempted and (roomy or not out.scheduled)
        ):  # fmt: skip
            request = self._waiting[0][-1]
            if not self._chunkable(request) and request.num_tokens > self.config.max_num_batched_tokens:
                # judged on the whole prompt, not on what the prefix cache holds now
                heapq.heappop(self._waiting)
                self._finish(request, "rejected", now=now, error=(
                    f"a prompt of {request.num_tokens} tokens exceeds max_num_batched_tokens="
                    f"{self.config.max_num_batched_tokens}; enable chunked prefill or raise the budget"
                ))  # fmt: skip
                out.rejected.append(request)
                continue
            if computing and self._holds(request, computing):
                heapq.heappop(self._waiting)
                held.append(request)
                continue
            try:
                per_chunk = {"chunk_tokens": budget} if self.manager.reserves_chunks else {}
                admission = self.manager.admit(
                    request.all_token_ids, max_new_tokens=request.max_new_tokens - len(request.output_token_ids),
                    priority=request.priority, salt=request.salt, keys=request.keys,
                    keep_free=reserve, **per_chunk,
                )
            except (CapacityError, InvalidArgumentError) as e:
                # the allocator checks before it changes anything: this request goes, the step goes on
                heapq.heappop(self._waiting)
                reason = "rejected" if isinstance(e, CapacityError) else "error"
                self._finish(request, reason, now=now, error=str(e))
                out.rejected.append(request)
                continue
            if admission is None:
                break
            chunk = self._chunk(request.num_tokens - admission.num_cached_tokens, budget, request)
            if chunk == 0:  # budget too small for an unchunked prompt now: give the blocks back
                self.manager.free(admission.seq_id)
                break  # a later step with a whole budget will take it (the prompt fits one)
            heapq.heappop(self._waiting)
            self._start(request, admission.seq_id, admission.num_cached_tokens, chunk, out)
            budget -= chunk
            reserve += self._growth_reserve([request])
            if self._matcher is not None:
                self._held.discard(request.request_id)
                computing.update(self._computes(request, admission.num_cached_tokens, out.scheduled[-1].end))
        for request in held:
            self._push_waiting(request)

    def _holds(self, request: Request, computing: set[Key]) -> bool:
        """Hold `request` back this step: its first uncached full block is in `computing`, and it was not
        held since it was last admitted (`hold_shared_prefix`; the module docstring)."""
        if self._matcher is None or request.request_id in self._held:
            return False
        try:
            num_cached = self._matcher.match_prefix(request.all_token_ids, salt=request.salt, keys=request.keys)
        except InvalidArgumentError:
            return False  # the admission reports it (as an error finish), not the hold
        first_missing = num_cached // self.manager.block_size  # partial reuse's tokens do not make a block
        keys = request.keys.keys  # keys[i + 1]: block i's; the lookup keyed up to its first missing block
        if len(keys) <= first_missing + 1 or keys[first_missing + 1] not in computing:
            return False
        self._held.add(request.request_id)
        return True

    def _computes(self, request: Request, num_cached: int, end: int) -> list[Key]:
        """The keys, as far as the admission's lookup computed them, of the uncached full blocks that this
        step's chunk of a just-admitted `request` completes (published after the forward)."""
        bs, keys = self.manager.block_size, request.keys.keys
        return keys[num_cached // bs + 1 : min(end // bs, len(keys) - 1) + 1]

    def _growth_reserve(self, requests: list[Request]) -> int:
        """Blocks `requests` would take from the pool to grow by `admission_lookahead` tokens each, or by
        what their `max_new_tokens` still allows where that is less."""
        look = self.config.admission_lookahead + self.num_lookahead_tokens
        if not look or not requests:
            return 0
        left = [r.max_new_tokens - len(r.output_token_ids) for r in requests]
        full = np.array([r.seq_id for r, n in zip(requests, left) if n >= look], dtype=np.int64)
        need = self.manager.num_blocks_to_append(full, look) if len(full) else 0
        for r, n in zip(requests, left):
            if 0 < n < look:
                need += self.manager.num_blocks_to_append(np.array([r.seq_id], dtype=np.int64), n)
        return need

    def _start(self, request: Request, seq_id: int, num_cached: int, chunk: int, out: SchedulerOutput) -> None:
        """An admitted request joins the running set with its first chunk scheduled."""
        request.seq_id = seq_id
        request.num_computed_tokens = num_cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        remaining = request.num_tokens - request.num_computed_tokens
        out.scheduled.append(self._planned(request, chunk, chunk == remaining, out))

    def _planned(self, request: Request, chunk: int, produces: bool, out: SchedulerOutput) -> ScheduledChunk:
        """The request's next chunk of `chunk` tokens. With a block source, the manager first fetches the
        full blocks at its head that a tier holds (never the block of its last token): they join the plan as
        a fill, count as computed, and the chunk starts after them (its budget stays spent)."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + chunk
        if self.source is not None and request.seq_id is not None and start % self.manager.block_size == 0:
            fill = self.manager.fetch_blocks(request.seq_id, start, end, self.source, request)
            if fill is not None:
                out.fills.append(fill)
                # a hybrid manager fills every group's copy of a block (`core/hybrid_fetch.py`)
                start += len(fill.dst) // self.manager.num_groups * self.manager.block_size
                request.num_computed_tokens = start
        return ScheduledChunk(request, start, end - start, produces)

    def _computed_only(self, plan: BlockMoves, request: Request) -> BlockMoves:
        """A swap plan cut to the blocks holding computed KV: the rest hold nothing yet, and the step may
        fill them from a tier (a second writer of the block, see `SchedulerOutput.check_writes`)."""
        if self.manager.reserves_chunks:
            return plan  # a hybrid manager's plans move only computed blocks, group after group
        keep = -(-request.num_computed_tokens // self.manager.block_size)
        return plan if keep >= len(plan.src) else BlockMoves(plan.src[:keep], plan.dst[:keep])

    def _chunkable(self, request: Request) -> bool:
        """May this request's tokens be computed over several steps? Always after a preemption (see the
        module docstring), else only with chunked prefill."""
        return self.config.enable_chunked_prefill or request.num_preemptions > 0

    def _chunk(self, remaining: int, budget: int, request: Request) -> int:
        if remaining <= budget:
            return remaining
        if self._chunkable(request):
            return budget
        return 0

    def _victim(self) -> Request:
        """The least important running request: lowest priority, then latest arrival."""
        return min(reversed(self.running), key=lambda r: (r.priority, -r.arrival_time))

    def _preempt(self, request: Request, out: SchedulerOutput, swap_out: list[BlockMoves]) -> None:
        self.running.remove(request)
        self.num_preemptions += 1
        request.num_preemptions += 1
        out.preempted.append(request)
        assert request.seq_id is not None, "scheduler: a running request without KV"
        if self.config.preemption_mode == "swap":
            plan = self.manager.swap_out(request.seq_id)
            if plan is not None:
                request.status = RequestStatus.SWAPPED
                self.swapped.append(request)
                swap_out.append(self._computed_only(plan, request))
                return
        self.manager.preempt(request.seq_id)
        self._swapped_in.pop(request.request_id, None)
        request.seq_id = None
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self._push_waiting(request)

    # --- after the step -------------------------------------------------------------------------

    def update(
        self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]], now: float = 0.0
    ) -> list[Request]:
        """Record the step's KV as computed and append sampled tokens; returns the requests that finished.

        `sampled[request_id]` is the token a request sampled, or for a speculating chunk the verified tokens
        (its accepted drafts, then the token after them): the rejected drafts are rolled back first."""
        live = [c for c in output.scheduled if c.request.status is RequestStatus.RUNNING]
        computed: list[tuple[Request, int]] = []
        for c in live:
            end = c.end
            if c.draft_token_ids:
                end -= self._roll_back_rejected(c, sampled.get(c.request.request_id, ()))
            c.request.num_computed_tokens = end
            if c.request.first_scheduled_time is None:
                c.request.first_scheduled_time = now
            computed.append((c.request, end))
        computed += [(r, r.num_computed_tokens) for r in self._forked if r.status is RequestStatus.RUNNING]
        if computed:
            seq_ids = np.array([r.seq_id for r, _ in computed], dtype=np.int64)
            self.manager.mark_computed(seq_ids, np.array([end for _, end in computed], dtype=np.int64))
        self._inflight, self._forked = {}, []
        finished: list[Request] = []
        for request_id, tokens in sampled.items():
            request = self._by_id.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            for token in [tokens] if isinstance(tokens, int | np.integer) else tokens:
                request.output_token_ids.append(int(token))
                if request.first_token_time is None:
                    request.first_token_time = now
                reason = self._stop_reason(request, int(token))
                if reason is not None:
                    self._finish(request, reason, now=now)
                    finished.append(request)
                    break
        return finished

    def _roll_back_rejected(self, chunk: ScheduledChunk, verified: int | Sequence[int]) -> int:
        """Give the allocator back the slots of the chunk's rejected drafts; returns how many. `verified` is
        the accepted drafts and the token after them (an int: none accepted)."""
        drafts = chunk.draft_token_ids
        tokens = [int(verified)] if isinstance(verified, int | np.integer) else [int(t) for t in verified]
        accepted = max(0, len(tokens) - 1)
        if accepted > len(drafts) or tuple(tokens[:accepted]) != drafts[:accepted]:
            raise InvalidArgumentError(
                f"update: request {chunk.request.request_id!r} verified {tokens} against drafts {list(drafts)}; "
                "the tokens before the last must be the accepted drafts, in order"
            )
        rejected = len(drafts) - accepted
        if rejected:
            assert chunk.request.seq_id is not None, "scheduler: a running request without KV"
            self.manager.rollback(chunk.request.seq_id, rejected)
        return rejected

    @staticmethod
    def _stop_reason(request: Request, token: int) -> str | None:
        if request.eos_token_id is not None and token == request.eos_token_id:
            return "stop"
        if token in request.stop_token_ids:
            return "stop"
        if len(request.output_token_ids) >= request.max_new_tokens:
            return "length"
        return None

    def finish(self, request: Request, reason: str, now: float | None = None, *, error: str | None = None) -> None:
        """Finish a request early (stop string, abort, error); frees its KV. A finished request is left as
        it is. `reason` must be one of `FINISH_REASONS`."""
        if reason not in FINISH_REASONS:
            raise InvalidArgumentError(f"finish reason must be one of {', '.join(FINISH_REASONS)}; got {reason!r}")
        if request.status is RequestStatus.FINISHED:
            return
        self._finish(request, reason, now=now, error=error)

    def _finish(self, request: Request, reason: str, *, now: float | None = None, error: str | None = None) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.status is RequestStatus.WAITING:
            self._waiting = [w for w in self._waiting if w[-1] is not request]
            heapq.heapify(self._waiting)
        if request.seq_id is not None:
            self.manager.free(request.seq_id)
            request.seq_id = None
            self._swapped_in.pop(request.request_id, None)
        self._held.discard(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        # never before its arrival: a rejection planned without a clock is stamped at the arrival
        request.finish_time = request.arrival_time if now is None else now
        self._by_id.pop(request.request_id, None)
        self._order_of.pop(request.request_id, None)

    # --- parallel sampling ----------------------------------------------------------------------

    def fork(self, parent: Request, request_id: str) -> Request:
        """A running copy of `parent` sharing its KV blocks (copy-on-write); it continues independently.

        Call it after the step that computed the parent's prompt, before `update`, and give the child its
        own sampled token in `update`'s `sampled`. `CapacityError` (nothing changed) when `max_num_seqs`
        requests already run or the allocator has no room for the fork.
        """
        if parent.status is not RequestStatus.RUNNING or parent.seq_id is None:
            raise InvalidArgumentError(f"can only fork a running request; {parent.request_id!r} is {parent.status.value}")
        if request_id in self._by_id:
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        if len(self.running) >= self.config.max_num_seqs:
            raise CapacityError(f"max_num_seqs={self.config.max_num_seqs} requests are running; cannot fork another")
        seq_id = self.manager.fork(parent.seq_id)
        if seq_id is None:
            raise CapacityError("not enough KV blocks to fork")
        child = Request(
            request_id, parent.prompt_token_ids, parent.max_new_tokens, arrival_time=parent.arrival_time,
            priority=parent.priority, eos_token_id=parent.eos_token_id, stop_token_ids=parent.stop_token_ids,
            salt=parent.salt,
        )  # fmt: skip
        child.output_token_ids = list(parent.output_token_ids)
        # the step being run computes the parent's chunk for the child too (their KV is shared)
        child.num_computed_tokens = self._inflight.get(parent.request_id, parent.num_computed_tokens)
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        child.seq_id = seq_id
        child.status = RequestStatus.RUNNING
        child.keys = parent.keys.copy()
        self.running.insert(self.running.index(parent) + 1, child)
        self._by_id[request_id] = child
        self._order_of[request_id] = self._order_of[parent.request_id]
        self._forked.append(child)
        return child

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            request = self._by_id.get(request_id)
            if request is not None:
                self._finish(request, "abort")

    # --- pausing (pagedkv.engine.lifecycle) ------------------------------------------------------

    def park(self) -> list[Request]:
        """Take every unfinished request out of the queues, in queue order, its KV freed as in a recompute
        preemption (the full blocks it published stay in the prefix cache while the epoch holds). They keep
        their ids and places; `finish` still ends them; `unpark` queues them again. Call between steps."""
        parked = [*self.running, *self.swapped, *(w[-1] for w in sorted(self._waiting, key=lambda w: w[:4]))]
        for request in parked:
            if request.seq_id is not None:
                self.manager.free(request.seq_id)
                self.num_preemptions += 1
                request.num_preemptions += 1
            self._swapped_in.pop(request.request_id, None)
            request.seq_id = None
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
        self.running, self.swapped, self._waiting = [], [], []
        return parked

    def unpark(self, parked: Iterable[Request]) -> None:
        """Queue again the requests `park` took out that have not finished since."""
        for request in parked:
            if request.status is RequestStatus.WAITING and request.request_id in self._by_id:
                self._push_waiting(request)
