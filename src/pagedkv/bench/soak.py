"""`pagedkv bench soak`: a black-box soak of both managers, checked against a shadow KV store.

It plays a caller that only reads the public API and the documented contracts. Random operations (admit
with shared prefixes, salts, request and block extra keys and priorities; batched append; mark_computed;
fork; rollback; free; preempt; swap out and in; pin and unpin; reset; epoch bumps; events; prefix queries;
batch views; and misuse) run in episodes, each on a fresh manager: paged with the C hot path, paged with
the Python reference, or the contiguous baseline, at block sizes 1, 16 and 32 and pools of 64-512 blocks,
so the pool is often full. The caller keeps its own copy of the KV, one int per slot holding
(epoch, context, token), where the context is the salt, the request extra key and the block's extra key:

- a swap plan is applied as soon as its call returns it; a step (the caller's forward) takes the copies
  (checked: one source per destination, destinations distinct, never a block onto itself), applies them,
  writes each sequence's uncomputed tokens at the slots `slot_mapping` gives, and marks them computed (the
  order `protocol.py` states);
- with a host tier below the device (`--tiers`, some paged episodes), blocks the device evicts are written
  back to it before anything writes the device again, and a sequence's next full blocks are fetched from
  it (`fetch_blocks`, the engine's tier hit, between swaps, copies and steps); what they bring must read
  back as the sequence's own tokens like any computed KV;
- after every step, every live sequence (swapped ones through their host blocks) must read back exactly
  its computed tokens, context and epoch; every admission's cached prefix must read back the prompt's
  tokens under the request's context and the current epoch;
- every call that fails (a capacity shortfall, or misuse, which must raise a one-line `PagedKVError`)
  must leave the observable state (free and used counts, tables, lengths, computed counts, stats) as it
  was; `check_invariants()` runs every 16 operations and at the end of each episode, where every block
  must be free again.

On the first violation the episode's operations are shrunk (ops removed while the violation persists) and
printed as Python lines that reproduce it. `run_soak` is the library entry point; its `patch` hook lets
tests inject bugs into each manager it builds and check that the soak catches them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from pagedkv.core import (
    BlockKeys,
    ContiguousKVManager,
    InvalidArgumentError,
    PagedKVError,
    PagedKVManager,
    PinError,
    PinHandle,
    hotpath,
)
from pagedkv.core.prefix import Key
from pagedkv.core.protocol import BlockMoves
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.keys import key_bytes
from pagedkv.tiers.slot_index import LruClock
from pagedkv.tiers.store import TieredStore
from pagedkv.tiers.value import BlockLayout

Op = tuple[Any, ...]
Patch = Callable[[Any], Any]  # manager -> manager (may patch it in place or return a wrapper)
VOCAB = 4  # a tiny vocabulary: prompts collide, so prefixes are shared often
SALTS = (b"", b"tenant-a", b"tenant-b")
EXTRAS = (b"", b"lora:1")
CHECK_EVERY = 16
EPISODE_OPS = 2500
MAX_LIVE = 24
WEIGHTS = {
    "admit": 18, "append": 22, "step": 16, "fork": 8, "rollback": 9, "free": 5, "preempt": 3, "swap_out": 3,
    "swap_in": 3, "pin": 2, "unpin": 2, "reset": 0.4, "epoch": 0.6, "events": 1, "match": 2, "misuse": 4,
    "views": 2,
}  # fmt: skip


class Violation(Exception):
    """What the soak found: the manager broke a documented contract."""


@dataclass(frozen=True)
class Config:
    kind: str  # "paged", "paged-python" or "contiguous"
    block_size: int
    num_blocks: int
    num_host_blocks: int = 0
    verify_hits: bool = False
    hash_fn: str = "sha256"
    prefix_caching: bool = True
    eviction: str = "lru"  # the pool's eviction policy (`pagedkv.core.eviction`; --policy)
    partial_reuse: bool = False  # copy a partially matching block at admission (--partial-reuse)
    tier_blocks: int = 0  # a host tier below the device, in blocks (--tiers)

    def build(self) -> Any:
        if self.kind == "contiguous":
            return ContiguousKVManager(self.num_blocks, self.block_size)
        return PagedKVManager(
            self.num_blocks, self.block_size, num_host_blocks=self.num_host_blocks, verify_hits=self.verify_hits,
            hash_fn=self.hash_fn, record_events=True, native=False if self.kind == "paged-python" else None,
            enable_prefix_caching=self.prefix_caching, eviction=self.eviction, partial_reuse=self.partial_reuse,
        )  # fmt: skip

    def source(self) -> str:
        if self.kind == "contiguous":
            return f"m = ContiguousKVManager({self.num_blocks}, {self.block_size})"
        native = ", native=False" if self.kind == "paged-python" else ""
        native += "" if self.prefix_caching else ", enable_prefix_caching=False"
        native += "" if self.eviction == "lru" else f", eviction={self.eviction!r}"
        native += ", partial_reuse=True" if self.partial_reuse else ""
        tier = f"  # + a host tier of {self.tier_blocks} blocks (fetch_blocks)" if self.tier_blocks else ""
        return (
            f"m = PagedKVManager({self.num_blocks}, {self.block_size}, num_host_blocks={self.num_host_blocks}, "
            f"verify_hits={self.verify_hits}, hash_fn={self.hash_fn!r}, record_events=True{native}){tier}"
        )


@dataclass
class Seq:
    sid: int
    tokens: list[int]
    computed: int
    salt: bytes
    extra: bytes
    block_extra: dict[int, bytes]
    epoch: int
    keys: BlockKeys | None
    swapped: bool = False
    cells: np.ndarray | None = None  # the expected KV cells of all its tokens (None: stale)
    keys_copied: bool = False  # keys copied by the caller at a fork: the manager holds its own copy


@dataclass
class SoakResult:
    ops: int
    seed: int
    seconds: float
    ops_per_s: float
    violations: int
    episodes: int
    episodes_by_kind: dict[str, int] = field(default_factory=dict)
    failed_calls: int = 0
    message: str | None = None
    reproduction: list[str] | None = None
    tier_blocks_loaded: int = 0  # blocks fetch_blocks brought from a host tier (--tiers)


class Episode:
    """One manager, the caller's model of it, and the checks. `execute` runs one op (skipping an op whose
    sequence no longer exists, so a shrunk op list still replays) and raises `Violation`."""

    def __init__(self, config: Config, patch: Patch | None = None) -> None:
        self.config = config
        m = config.build()
        self.m = patch(m) if patch is not None else m
        self.paged = config.kind != "contiguous"
        bs = config.block_size
        self.dev = np.full(config.num_blocks * bs, -1, dtype=np.int64)
        self.host = np.full(max(config.num_host_blocks, 1) * bs, -1, dtype=np.int64)
        self.seqs: dict[int, Seq] = {}
        self.pins: list[PinHandle] = []
        self.epoch = 0
        self.contexts: dict[tuple[bytes, bytes, bytes], int] = {}
        self.lines: list[str] = [config.source()]
        self.ops_done = 0
        self.failed_calls = 0
        self.tier: TieredStore | None = None  # a host tier below the device (Config.tier_blocks)
        self.tier_blocks_loaded = 0
        if config.tier_blocks and self.paged:  # a block's cells as bytes: bs int64 = 2 * bs float32
            layout = BlockLayout("float32", (1, 2, bs, 1, 1))
            self.tier = TieredStore(layout, [HostTier(config.tier_blocks, layout, LruClock())])

    # --- the caller's model ---------------------------------------------------------------------

    def _ctx(self, seq: Seq, block: int) -> int:
        return self.contexts.setdefault((seq.salt, seq.extra, seq.block_extra.get(block, b"")), len(self.contexts))

    def expected(self, seq: Seq, upto: int) -> np.ndarray:
        if seq.cells is None or len(seq.cells) != len(seq.tokens):
            bs = self.config.block_size
            per_block = np.array([self._ctx(seq, b) for b in range(-(-len(seq.tokens) // bs))], dtype=np.int64)
            ctx = np.repeat(per_block, bs)[: len(seq.tokens)]
            seq.cells = (np.int64(seq.epoch) << 40) | (ctx << 20) | np.asarray(seq.tokens, dtype=np.int64)
        return seq.cells[:upto]

    def _on_device(self) -> list[int]:
        return [x for x, s in self.seqs.items() if not s.swapped]

    def fingerprint(self) -> tuple[object, ...]:
        """The observable state, through the public API only (batched: one call per view)."""
        m = self.m
        labels = sorted(self._on_device())
        sids = [self.seqs[x].sid for x in labels]
        views: tuple[object, ...] = ()
        if sids:
            views = (m.block_table(sids).tobytes(), m.seq_lens(sids).tobytes())
        away = tuple((x, m.num_tokens(s.sid), tuple(m.block_ids(s.sid))) for x, s in self.seqs.items() if s.swapped)
        extra: tuple[object, ...] = (m.stats, m.epoch) if self.paged else ()
        return (m.num_free_blocks, m.num_used_blocks, m.num_sequences, tuple(labels), views, away, extra)

    def read_back(self) -> None:
        """Every live sequence's computed tokens read back exactly (from host blocks if swapped out)."""
        bs = self.config.block_size
        labels = [x for x in self._on_device() if self.seqs[x].computed]
        if labels:
            seqs = [self.seqs[x] for x in labels]
            got = self.dev[self.m.slot_mapping([s.sid for s in seqs], 0, [s.computed for s in seqs])]
            want = np.concatenate([self.expected(s, s.computed) for s in seqs])
            if not np.array_equal(got, want):
                bad = int(np.argmax(got != want))
                ends = np.cumsum([s.computed for s in seqs])
                i = int(np.searchsorted(ends, bad, side="right"))
                self._wrong(labels[i], "device", bad - (int(ends[i - 1]) if i else 0), got[bad], want[bad])
        for label, s in self.seqs.items():
            if s.swapped and s.computed:
                if not self.m.is_swapped(s.sid):
                    raise Violation(f"s{label} is swapped out but the manager says it is not")
                blocks = np.asarray(self.m.block_ids(s.sid), dtype=np.int64)
                pos = np.arange(s.computed)
                got = self.host[blocks[pos // bs] * bs + pos % bs]
                want = self.expected(s, s.computed)
                if not np.array_equal(got, want):
                    bad = int(np.argmax(got != want))
                    self._wrong(label, "host", bad, got[bad], want[bad])

    @staticmethod
    def _wrong(label: int, where: str, token: int, got: np.int64, want: np.int64) -> None:
        raise Violation(
            f"sequence s{label} reads back wrong KV at token {token} ({where}): "
            f"got {_cell(int(got))}, want {_cell(int(want))}"
        )

    # --- ops ------------------------------------------------------------------------------------

    def execute(self, op: Op) -> None:
        name = op[0]
        if any(label not in self.seqs for label in _labels(op)):
            return  # a shrunk list: this op's sequence was never created
        if name in ("append", "fork", "rollback", "views", "fetch") and any(self.seqs[x].swapped for x in _labels(op)):
            return  # ... or is swapped out now
        before = self.fingerprint() if name in _MAY_FAIL else None
        try:
            getattr(self, "op_" + name)(*op[1:])
        except Violation:
            raise
        except PagedKVError as e:
            raise Violation(f"{name}: unexpected {type(e).__name__}: {e}") from e
        except Exception as e:  # noqa: BLE001 - anything else is an untyped failure
            raise Violation(f"{name}: untyped {type(e).__name__}: {e}") from e
        if before is not None and self._failed:
            self.failed_calls += 1
            if self.fingerprint() != before:
                raise Violation(f"{name}: a failed call changed the observable state")
        self._failed = False
        self.ops_done += 1
        if self.ops_done % CHECK_EVERY == 0:
            self.check()

    _failed = False

    def check(self) -> None:
        try:
            self.m.check_invariants()
        except PagedKVError as e:
            raise Violation(f"check_invariants: {e}") from e
        if self.paged:
            for label, s in self.seqs.items():
                if self.m.num_computed_tokens(s.sid) != s.computed or self.m.is_swapped(s.sid) != s.swapped:
                    raise Violation(f"s{label}: computed tokens or swap state disagree with the calls made")

    def op_admit(self, label: int, tokens: list[int], salt: bytes, extra: bytes, block_extra: dict[int, bytes],
                 priority: int, use_keys: bool, max_new: int, own: BlockKeys | None = None,
                 copied: bool = False) -> None:  # fmt: skip
        keys = BlockKeys(salt, extra=extra, block_extra=block_extra) if use_keys or extra or block_extra else None
        keys = own if own is not None else keys  # a re-admitted request brings the keys it had
        adm = self.m.admit(tokens, max_new_tokens=max_new, priority=priority, salt=b"" if keys else salt, keys=keys)
        kw = f"keys=BlockKeys({salt!r}, extra={extra!r}, block_extra={block_extra!r})" if keys else f"salt={salt!r}"
        if own is not None:
            kw = f"keys=k{label}"
        elif keys is not None:
            self.lines.append(f"k{label} = BlockKeys({salt!r}, extra={extra!r}, block_extra={block_extra!r})")
            kw = f"keys=k{label}"
        if adm is None:
            self._failed = True
            self.lines.append(f"m.admit({tokens}, max_new_tokens={max_new}, priority={priority}, {kw})  # None")
            return
        self.lines.append(f"s{label} = m.admit({tokens}, max_new_tokens={max_new}, priority={priority}, {kw}).seq_id")
        seq = Seq(adm.seq_id, list(tokens), 0, salt, extra, dict(block_extra), self.epoch, keys)
        seq.keys_copied = copied
        cached = adm.num_cached_tokens
        if cached:
            if not self.paged or (cached % self.config.block_size and not self.config.partial_reuse) or cached >= len(tokens):
                raise Violation(f"admit: {cached} cached tokens of a {len(tokens)}-token prompt")
            full = cached - cached % self.config.block_size  # a partial block's copy runs at the step: checked then
            got = self.dev[self.m.slot_mapping([adm.seq_id], [0], [full])]
            want = self.expected(seq, full)
            if not np.array_equal(got, want):
                bad = int(np.argmax(got != want))
                raise Violation(
                    f"admit: a prefix hit serves KV that is not the prompt's at token {bad}: "
                    f"got {_cell(int(got[bad]))}, want {_cell(int(want[bad]))}"
                )
        seq.computed = cached
        self.seqs[label] = seq
        if self.tier is not None:  # the engine's scheduler asks the tiers for the first chunk at once
            self.op_fetch(label)

    def op_append(self, labels: list[int], new: list[list[int]]) -> None:
        sids = [self.seqs[x].sid for x in labels]
        k = len(new[0])
        need = self.m.num_blocks_to_append(sids, k) if self.paged else None
        free = self.m.num_free_blocks
        ok = self.m.append(sids, np.array(new, dtype=np.int64).reshape(len(sids), k), num_tokens=k)
        names = "[" + ", ".join(f"s{x}" for x in labels) + "]"
        self.lines.append(f"m.append({names}, {new}, num_tokens={k})" + ("" if ok else "  # False"))
        if need is not None and ok != (need <= free):
            raise Violation(f"append answered {ok} with {need} blocks needed and {free} free")
        if not ok:
            self._failed = True
            return
        for x, toks in zip(labels, new):
            self.seqs[x].tokens.extend(toks)
            self.seqs[x].cells = None

    def take_copies(self) -> BlockMoves:
        """`m.take_copies()`, checked against its contract: one source per destination, destinations
        distinct, never a copy from a block onto itself."""
        copies = self.m.take_copies()
        self.lines.append("m.take_copies()")
        src, dst = copies.src.tolist(), copies.dst.tolist()
        if len(src) != len(dst) or len(set(dst)) != len(dst):
            raise Violation(f"take_copies: {len(src)} sources for {len(dst)} destinations, {len(set(dst))} distinct")
        selfish = [s for s, d in zip(src, dst) if s == d]
        if selfish:
            raise Violation(f"take_copies: copies from a block onto itself (blocks {selfish[:4]})")
        return copies

    def op_step(self, labels: list[int], partial: list[int]) -> None:
        """The caller's forward: copies, then write the uncomputed tokens, then mark them computed."""
        bs = self.config.block_size
        self._sync_tier()
        copies = self.take_copies()
        if len(copies.src):
            dev = self.dev.reshape(-1, bs)
            dev[copies.dst] = dev[copies.src]
        live = [x for x in labels if x in self.seqs and not self.seqs[x].swapped]
        if live:
            seqs = [self.seqs[x] for x in live]
            starts = [s.computed for s in seqs]
            ends = [max(s.computed, len(s.tokens) - cut) for s, cut in zip(seqs, partial)]
            sids = [s.sid for s in seqs]
            if any(e > b for b, e in zip(starts, ends)):
                slots = self.m.slot_mapping(sids, starts, ends)
                self.dev[slots] = np.concatenate([self.expected(s, e)[b:] for s, b, e in zip(seqs, starts, ends)])
            self.m.mark_computed(sids, ends)
            self.lines.append(f"m.mark_computed([{', '.join(f's{x}' for x in live)}], {ends})")
            for x, end in zip(live, ends):
                self.seqs[x].computed = end
        self.read_back()

    def op_fork(self, label: int, child: int) -> None:
        s = self.seqs[label]
        sid = self.m.fork(s.sid)
        if sid is None:
            self._failed = True
            self.lines.append(f"m.fork(s{label})  # None")
            return
        self.lines.append(f"s{child} = m.fork(s{label})")
        keys = s.keys.copy() if s.keys is not None else None
        self.seqs[child] = Seq(sid, list(s.tokens), s.computed, s.salt, s.extra, dict(s.block_extra), s.epoch, keys)
        self.seqs[child].keys_copied = keys is not None
        if keys is not None:
            self.lines.append(f"k{child} = k{label}.copy()")

    def op_rollback(self, label: int, n: int) -> None:
        s = self.seqs[label]
        n = min(n, len(s.tokens) - 1)
        if not self.paged:
            return  # the contiguous baseline has no rollback
        self.m.rollback(s.sid, n)
        self.lines.append(f"m.rollback(s{label}, {n})")
        del s.tokens[len(s.tokens) - n :]
        s.cells = None
        s.computed = min(s.computed, len(s.tokens))
        if s.keys is not None and s.keys_copied:  # the manager truncates the keys it was given, not this copy
            s.keys.truncate(len(s.tokens) // self.config.block_size, len(s.tokens))
            self.lines.append(f"k{label}.truncate({len(s.tokens) // self.config.block_size}, {len(s.tokens)})")

    def op_free(self, label: int) -> None:
        self.m.free(self.seqs.pop(label).sid)
        self.lines.append(f"m.free(s{label})")

    def op_preempt(self, label: int, readmit: bool) -> None:
        s = self.seqs.pop(label)
        n = self.m.preempt(s.sid)
        self.lines.append(f"m.preempt(s{label})")
        if n != len(s.tokens):
            raise Violation(f"preempt returned {n} for a sequence of {len(s.tokens)} tokens")
        if readmit:  # the request comes back with its own BlockKeys
            self.op_admit(label, s.tokens, s.salt, s.extra, s.block_extra, 0, True, 0, s.keys, s.keys_copied)

    def op_swap_out(self, label: int) -> None:
        s = self.seqs[label]
        if self.paged and not s.swapped and self.config.num_host_blocks:
            self._swap(label, "swap_out", self.dev, self.host)

    def op_swap_in(self, label: int) -> None:
        if self.seqs[label].swapped:
            self._sync_tier()
            self._swap(label, "swap_in", self.host, self.dev)

    def _swap(self, label: int, verb: str, src: np.ndarray, dst: np.ndarray) -> None:
        """`m.swap_out` or `m.swap_in` of sequence `label`, then its cells moved as the plan says (src -> dst)."""
        s = self.seqs[label]
        plan = getattr(self.m, verb)(s.sid)
        self.lines.append(f"m.{verb}(s{label})" + ("  # None" if plan is None else ""))
        if plan is None:
            self._failed = True
            return
        s.swapped = verb == "swap_out"
        bs = self.config.block_size
        dst.reshape(-1, bs)[plan.dst] = src.reshape(-1, bs)[plan.src]

    # --- the host tier (Config.tier_blocks) -----------------------------------------------------

    def _sync_tier(self) -> None:
        """Copy the blocks the device evicted or published since the last sync into the tier, before anything
        writes the device (their cells are still the published ones), as the engine's tiering does."""
        if self.tier is None:
            return
        events = self.m.take_events()
        if any(e.kind not in ("stored", "removed", "cleared") for e in events):
            raise Violation("take_events returned an event of an unknown kind")
        # evicted blocks (written back) and published ones (written through, as to a remote store): either
        # way the block still holds the KV its key names, since the last sync came before any write
        blocks = {key_bytes(e.key): int(e.block_id) for e in events
                  if e.kind in ("removed", "stored") and e.key is not None and e.block_id is not None}  # fmt: skip
        plan = self.tier.prepare_store(blocks, [])
        if plan.keys:
            bs = self.config.block_size
            cells = self.dev.reshape(-1, bs)[[blocks[k] for k in plan.keys]]
            plan.rows[:] = np.ascontiguousarray(cells).view(np.uint8).reshape(len(plan.keys), -1)
            self.tier.complete_store(plan)

    def fetch(self, keys: Sequence[Key], first_block: int, tag: object) -> tuple[int, np.ndarray]:
        """`BlockSource.fetch`: the leading blocks of `keys` the host tier holds."""
        assert self.tier is not None, "soak: fetch without a tier"
        rows = np.empty((len(keys), self.tier.layout.nbytes), dtype=np.uint8)
        plan = self.tier.prepare_load([key_bytes(k) for k in keys], rows)
        self.tier.complete_load(plan, self.config.block_size)
        return plan.num_blocks, rows

    def op_fetch(self, label: int) -> None:
        """A tier hit, as the engine's scheduler plans one for a chunk that starts on a block boundary: the
        manager keys the sequence's next full blocks and the tier fills the leading ones it holds; the
        caller writes them and marks them computed. `read_back` checks the KV they brought."""
        s, bs = self.seqs[label], self.config.block_size
        if self.tier is None or s.computed % bs or s.computed >= len(s.tokens):
            return
        self._sync_tier()
        copies = self.take_copies()  # the step's order: copies, then fills (then the forward)
        if len(copies.src):
            self.dev.reshape(-1, bs)[copies.dst] = self.dev.reshape(-1, bs)[copies.src]
        fill = self.m.fetch_blocks(s.sid, s.computed, len(s.tokens), self, label)
        self.lines.append(f"m.fetch_blocks(s{label}, {s.computed}, {len(s.tokens)}, tier)" + ("" if fill else "  # None"))
        if fill is None:
            return
        n, first = len(fill.dst), s.computed // bs
        if fill.dst.tolist() != self.m.block_ids(s.sid)[first : first + n] or s.computed + n * bs > (len(s.tokens) - 1) // bs * bs:
            raise Violation(f"fetch_blocks filled blocks {fill.dst.tolist()}, not s{label}'s next full blocks")
        self.dev.reshape(-1, bs)[fill.dst] = np.ascontiguousarray(fill.rows).view(np.int64).reshape(n, bs)
        self.m.mark_computed([s.sid], [s.computed + n * bs])
        self.lines.append(f"m.mark_computed([s{label}], [{s.computed + n * bs}])")
        s.computed += n * bs
        self.tier_blocks_loaded += n
        self.read_back()

    def op_pin(self, tokens: list[int], salt: bytes) -> None:
        if not self.paged:
            return
        cached = self.m.match_prefix([*tokens, 0], salt=salt)
        try:
            self.pins.append(self.m.pin(tokens, salt=salt))
            self.lines.append(f"pins.append(m.pin({tokens}, salt={salt!r}))")
        except PinError:
            self._failed = True
            if cached >= self.config.block_size:  # a pin holds full blocks (a partial reuse is no pin)
                raise Violation("pin refused a prefix that is cached") from None

    def op_unpin(self) -> None:
        if self.pins:
            self.m.unpin(self.pins.pop(0))
            self.lines.append("m.unpin(pins.pop(0))")

    def op_reset(self) -> None:
        if self.paged:
            self.m.reset_prefix_cache()
            self.lines.append("m.reset_prefix_cache()")

    def op_epoch(self) -> None:
        if self.paged:
            self.epoch += 1
            got = self.m.bump_epoch()
            self.lines.append("m.bump_epoch()")
            if got != self.epoch or self.m.epoch != self.epoch:
                raise Violation(f"bump_epoch: epoch {got} (property {self.m.epoch}) after {self.epoch} bumps")

    def op_events(self) -> None:
        if self.tier is not None:
            self._sync_tier()
        elif self.paged:
            events = self.m.take_events()
            if any(e.kind not in ("stored", "removed", "cleared") for e in events):
                raise Violation("take_events returned an event of an unknown kind")

    def op_match(self, tokens: list[int], salt: bytes) -> None:
        """A prefix query must agree with the admission that follows it (a hit served is re-checked there)."""
        if self.paged:
            n = self.m.match_prefix(tokens, salt=salt)
            if (n % self.config.block_size and not self.config.partial_reuse) or n >= len(tokens):
                raise Violation(f"match_prefix answered {n} for {len(tokens)} tokens")
        fits = self.m.can_admit(tokens)
        if not isinstance(fits, bool):
            raise Violation("can_admit did not answer a bool")

    def op_views(self, labels: list[int]) -> None:
        live = [x for x in labels if not self.seqs[x].swapped]
        if not live:
            return
        sids = [self.seqs[x].sid for x in live]
        lens = self.m.seq_lens(sids)
        want = [len(self.seqs[x].tokens) for x in live]
        if lens.tolist() != want:
            raise Violation(f"seq_lens {lens.tolist()} != {want}")
        table = self.m.block_table(sids, pad_id=0)
        csr = self.m.csr(sids)
        bs = self.config.block_size
        for i, x in enumerate(live):
            blocks = self.m.block_ids(self.seqs[x].sid)
            pages = -(-want[i] // bs)
            if csr.indices[csr.indptr[i] : csr.indptr[i + 1]].tolist() != blocks[:pages] or table[i, : len(blocks)].tolist() != blocks:
                raise Violation(f"batch views of s{x} disagree with its block ids")

    def op_misuse(self, which: int, label: int) -> None:
        s = self.seqs[label]
        cases = _misuse_cases(self, s)
        name, call, error = cases[which % len(cases)]
        before = self.fingerprint()
        try:
            call()
        except PagedKVError as e:
            self.failed_calls += 1
            if not isinstance(e, error):
                raise Violation(f"misuse {name!r}: {type(e).__name__} instead of {error.__name__}: {e}") from e
            if "\n" in str(e) or not str(e):
                raise Violation(f"misuse {name!r}: the error is not one line: {e!r}") from e
        except Exception as e:  # noqa: BLE001
            raise Violation(f"misuse {name!r}: untyped {type(e).__name__}: {e}") from e
        else:
            raise Violation(f"misuse {name!r} was accepted")
        if self.fingerprint() != before:
            raise Violation(f"misuse {name!r}: the failed call changed the observable state")

    def finish(self) -> None:
        """Release everything: every block must be free again."""
        for label in list(self.seqs):
            self.op_free(label)
        while self.pins:
            self.op_unpin()
        self.take_copies()
        self.check()
        if self.m.num_used_blocks != 0 or self.m.num_free_blocks != self.m.num_blocks:
            raise Violation(
                f"after freeing everything {self.m.num_used_blocks} blocks are in use "
                f"and {self.m.num_free_blocks} of {self.m.num_blocks} free"
            )


_MAY_FAIL = {"admit", "append", "fork", "swap_out", "swap_in", "pin"}


def _labels(op: Op) -> list[int]:
    name = op[0]
    if name in ("append", "views"):
        return list(op[1])
    if name in ("fork", "rollback", "free", "preempt", "swap_out", "swap_in", "fetch"):
        return [op[1]]
    if name == "misuse":
        return [op[2]]
    return []


def _cell(value: int) -> str:
    if value < 0:
        return "nothing written"
    return f"(epoch {value >> 40}, context {(value >> 20) & 0xFFFFF}, token {value & 0xFFFFF})"


def _misuse_cases(ep: Episode, s: Seq) -> list[tuple[str, Callable[[], object], type[Exception]]]:
    m, sid = ep.m, s.sid
    other = [t + 1 for t in s.tokens] if s.keys is not None else [0]
    cases: list[tuple[str, Callable[[], object], type[Exception]]] = [
        ("priority 2**70", lambda: m.admit([1, 2], priority=2**70), InvalidArgumentError),
        ("priority str", lambda: m.admit([1, 2], priority="x"), InvalidArgumentError),
        ("priority None", lambda: m.admit([1, 2], priority=None), InvalidArgumentError),
        ("empty prompt", lambda: m.admit([]), InvalidArgumentError),
        ("float tokens", lambda: m.admit([1.5]), InvalidArgumentError),
        ("token 2**63", lambda: m.admit([2**63]), InvalidArgumentError),
        ("keys junk", lambda: m.admit([1, 2], keys="junk"), InvalidArgumentError),
        ("max_new 2**63", lambda: m.admit([1], max_new_tokens=2**63), InvalidArgumentError),
        ("append 2**63-1", lambda: m.append([sid], None, num_tokens=2**63 - 1), InvalidArgumentError),
        ("append bool count", lambda: m.append([sid], None, num_tokens=True), InvalidArgumentError),
        ("mark past length", lambda: m.mark_computed([sid], [len(s.tokens) + 1]), InvalidArgumentError),
        ("mark float", lambda: m.mark_computed([sid], [0.5]), InvalidArgumentError),
        ("mark str", lambda: m.mark_computed([sid], ["x"]), InvalidArgumentError),
        ("slot float end", lambda: m.slot_mapping([sid], [0], [1.5]), InvalidArgumentError),
        ("slot str end", lambda: m.slot_mapping([sid], [0], ["x"]), InvalidArgumentError),
        ("pad_id float", lambda: m.block_table([sid], pad_id=1.5), InvalidArgumentError),
        ("pad_id bool", lambda: m.block_table([sid], pad_id=True), InvalidArgumentError),
        ("can_admit -1", lambda: m.can_admit([1], max_new_tokens=-1), InvalidArgumentError),
        ("free unknown", lambda: m.free(10**6), PagedKVError),
        ("fork str", lambda: m.fork("x"), InvalidArgumentError),
        ("seq id 2**63", lambda: m.append([2**63], None), InvalidArgumentError),
    ]
    if ep.paged:
        swapped = s.swapped
        cases += [
            ("rollback too far", lambda: m.rollback(sid, len(s.tokens) + 1), InvalidArgumentError),
            ("unpin junk", lambda: m.unpin((1,)), InvalidArgumentError),
            ("pin uncached", lambda: m.pin([VOCAB + 7] * (ep.config.block_size + 1)), PinError),
        ]
        if s.keys is not None and s.tokens != other:
            cases.append(("keys reused", lambda: m.admit(other, keys=s.keys), InvalidArgumentError))
        if not swapped:
            cases.append(("swap_in running", lambda: m.swap_in(sid), InvalidArgumentError))
    if s.swapped:  # views of a swapped sequence are misuse too
        cases = [c for c in cases if not c[0].startswith(("mark", "slot", "pad_id", "append"))]
    return cases


class Generator:
    """Draws ops from a seeded rng and the episode's current state (labels, not sequence ids)."""

    def __init__(self, rng: np.random.Generator, config: Config) -> None:
        self.rng = rng
        self.config = config
        bs = config.block_size
        self.docs = [rng.integers(0, VOCAB, size=int(rng.integers(bs, 4 * bs + 2))).tolist() for _ in range(4)]
        self.next_label = 0
        self.names = list(WEIGHTS)
        w = np.array([WEIGHTS[n] for n in self.names], dtype=float)
        self.p = w / w.sum()

    def prompt(self) -> list[int]:
        rng, bs = self.rng, self.config.block_size
        doc = self.docs[int(rng.integers(len(self.docs)))]
        head = doc[: int(rng.integers(0, len(doc) + 1))]
        tail = rng.integers(0, VOCAB, size=int(rng.integers(0 if head else 1, 2 * bs + 2))).tolist()
        return head + tail

    def families(self, ep: Episode, on_dev: list[int]) -> list[list[int]]:
        """Groups of on-device sequences whose last token lies in the same block (read from `block_ids`)."""
        bs, groups = self.config.block_size, {}
        for x in on_dev:
            s = ep.seqs[x]
            groups.setdefault(ep.m.block_ids(s.sid)[(len(s.tokens) - 1) // bs], []).append(x)
        return [g for g in groups.values() if len(g) > 1]

    def into_shared(self, ep: Episode, label: int, on_dev: list[int], default: int) -> int:
        """A rollback count that ends `label` inside the last block it shares with another sequence."""
        bs, s = self.config.block_size, ep.seqs[label]
        if bs == 1:
            return default
        mine = ep.m.block_ids(s.sid)[: -(-len(s.tokens) // bs)]
        others = {b for x in on_dev if x != label for b in ep.m.block_ids(ep.seqs[x].sid)}
        shared = [j for j, b in enumerate(mine) if b in others]
        if not shared:
            return default
        target = shared[-1] * bs + int(self.rng.integers(1, bs))
        return len(s.tokens) - target if 0 < target < len(s.tokens) else default

    def draw(self, ep: Episode) -> Op:
        labels = sorted(ep.seqs)
        on_dev = [x for x in labels if not ep.seqs[x].swapped]
        name = self._op_name(labels, on_dev)
        if name == "admit":
            return self._draw_admit()
        if name == "append":
            return self._draw_append(ep, on_dev)
        if name == "rollback":
            label = self._pick(on_dev)
            n = int(self.rng.integers(0, self.config.block_size + 2))
            if self.rng.random() < 0.7:  # into the last block it shares with another sequence (the hard case)
                n = self.into_shared(ep, label, on_dev, n)
            return ("rollback", label, n)
        return self._draw_other(name, labels, on_dev)

    def _pick(self, xs: Sequence[Any]) -> Any:
        return xs[int(self.rng.integers(len(xs)))]

    def _op_name(self, labels: list[int], on_dev: list[int]) -> str:
        """The next operation's kind, by the weights; one that needs sequences becomes "admit" without them."""
        rng = self.rng
        name = self.names[int(rng.choice(len(self.names), p=self.p))]
        if name == "admit" and len(labels) > MAX_LIVE:  # keep the batch small enough to check every step
            name = "free" if rng.random() < 0.7 else "preempt"
        if name in ("append", "fork", "rollback", "views", "misuse") and not on_dev:
            name = "admit"
        if name in ("free", "preempt", "swap_out", "swap_in") and not labels:
            name = "admit"
        if self.config.tier_blocks:  # tier episodes only: the others draw as before
            if name == "step" and on_dev and rng.random() < 0.5:
                name = "fetch"
            elif name in ("pin", "match") and rng.random() < 0.3:
                name = "reset"  # the device forgets its prefixes, the tier keeps them: admissions then fetch
        return name

    def _draw_admit(self) -> Op:
        rng, pick = self.rng, self._pick
        self.next_label += 1
        block_extra = {1: b"image:" + bytes([int(rng.integers(2))])} if rng.random() < 0.1 else {}
        return ("admit", self.next_label, self.prompt(), pick(SALTS), pick(EXTRAS) if rng.random() < 0.2 else b"",
                block_extra, int(rng.integers(-1, 3)), bool(rng.random() < 0.5),
                int(rng.integers(0, 3 * self.config.block_size)))  # fmt: skip

    def _draw_append(self, ep: Episode, on_dev: list[int]) -> Op:
        rng, pick = self.rng, self._pick
        batch = [x for x in on_dev if rng.random() < 0.6] or [pick(on_dev)]
        if rng.random() < 0.5 and (families := self.families(ep, on_dev)):
            batch = pick(families)  # every holder of a shared last block writes in one batch
        k = int(rng.integers(1, 4)) if rng.random() < 0.8 else int(rng.integers(1, self.config.block_size + 2))
        return ("append", batch, rng.integers(0, VOCAB, size=(len(batch), k)).tolist())

    def _draw_other(self, name: str, labels: list[int], on_dev: list[int]) -> Op:
        rng, pick = self.rng, self._pick
        if name == "step":
            return ("step", labels, [int(rng.integers(0, 3)) if rng.random() < 0.2 else 0 for _ in labels])
        if name == "fork":
            self.next_label += 1
            return ("fork", pick(on_dev), self.next_label)
        if name in ("free", "swap_out", "swap_in"):
            return (name, pick(labels))
        if name == "fetch":  # often the newest sequence: fresh from admission, its prompt not computed yet
            return ("fetch", self.next_label if self.next_label in on_dev and rng.random() < 0.7 else pick(on_dev))
        if name == "preempt":
            return ("preempt", pick(labels), bool(rng.random() < 0.7))
        if name in ("pin", "match"):
            doc = pick(self.docs)
            return (name, doc[: int(rng.integers(1, len(doc) + 1))], pick(SALTS))
        if name == "views":
            return ("views", [x for x in on_dev if rng.random() < 0.5] or [pick(on_dev)])
        if name == "misuse":
            return ("misuse", int(rng.integers(1 << 30)), pick(on_dev))
        return (name,)


def draw_config(
    rng: np.random.Generator, kinds: tuple[str, ...], policies: tuple[str, ...] = ("lru",), partial_reuse: bool = False,
    tiers: bool = False,
) -> Config:
    """A random episode configuration; `policies` and `partial_reuse` other than the defaults take more draws
    (the default runs replay as before)."""
    kind = kinds[int(rng.integers(len(kinds)))]
    config = _draw_sizes(rng, kind)
    if len(policies) > 1 or policies != ("lru",):
        config = replace(config, eviction=policies[int(rng.integers(len(policies)))])
    if partial_reuse:  # half the episodes
        config = replace(config, partial_reuse=bool(rng.random() < 0.5))
    if tiers and config.kind != "contiguous" and config.prefix_caching and rng.random() < 0.5:
        config = replace(config, tier_blocks=(16, 1024)[int(rng.integers(2))])
    return config


def _draw_sizes(rng: np.random.Generator, kind: str) -> Config:
    bs = (1, 16, 32)[int(rng.integers(3))]
    num_blocks = int(rng.integers(64, 513))
    if kind == "contiguous":
        return Config(kind, bs, num_blocks)
    return Config(kind, bs, num_blocks, num_host_blocks=(0, 32, 128)[int(rng.integers(3))],
                  verify_hits=bool(rng.random() < 0.3), hash_fn="fast" if rng.random() < 0.3 else "sha256",
                  prefix_caching=bool(rng.random() >= 0.25))  # fmt: skip


def replay(config: Config, ops: list[Op], patch: Patch | None) -> tuple[str | None, list[str]]:
    """Run `ops` on a fresh episode: the violation message (or None) and the calls it made. A shrinking
    trial may drive a patched (broken) manager into a state where it raises instead of giving a wrong
    answer: that is another failure, reported as `crash: ...`, so the shrinker never keeps the trial."""
    ep = Episode(config, patch)
    try:
        for op in ops:
            ep.execute(op)
        ep.finish()
    except Violation as v:
        return str(v), ep.lines
    except Exception as e:  # any other exception is a different failure, never a pass
        return f"crash: {type(e).__name__}: {e}", ep.lines
    return None, ep.lines


def shrink(config: Config, ops: list[Op], patch: Patch | None, budget_s: float = 20.0) -> tuple[list[Op], str, list[str]]:
    """Remove ops while the replay still fails (chunks, then single ops), within a time budget."""
    message, lines = replay(config, ops, patch)
    assert message is not None, "soak: the failing episode did not fail again on replay"
    kind = message.split(":")[0]  # keep the same kind of failure while shrinking
    deadline = time.monotonic() + budget_s
    chunk = max(1, len(ops) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i, removed = 0, False
        while i < len(ops) and time.monotonic() < deadline:
            trial = ops[:i] + ops[i + chunk :]
            got, trial_lines = replay(config, trial, patch)
            if got is not None and got.split(":")[0] == kind:
                ops, message, lines, removed = trial, got, trial_lines, True
            else:
                i += chunk
        if not removed:
            chunk //= 2
    return ops, message, lines


def run_soak(
    ops: int, seed: int = 0, *, patch: Patch | None = None, kinds: tuple[str, ...] | None = None,
    progress: bool = False, shrink_s: float = 20.0, policies: tuple[str, ...] = ("lru",), partial_reuse: bool = False,
    tiers: bool = False,
) -> SoakResult:  # fmt: skip
    """Run `ops` random operations in episodes; stop at the first violation (then shrink it). Paged episodes
    draw their eviction policy from `policies`."""
    rng = np.random.default_rng(seed)
    if kinds is None:
        kinds = ("paged", "paged-python", "contiguous") if hotpath.NATIVE is not None else ("paged-python", "contiguous")
    done = episodes = failed = loaded = 0
    by_kind: dict[str, int] = {}
    start = time.perf_counter()
    shown = -1
    while done < ops:
        config = draw_config(rng, kinds, policies, partial_reuse, tiers)
        gen = Generator(rng, config)
        ep = Episode(config, patch)
        log: list[Op] = []
        episodes += 1
        by_kind[config.kind] = by_kind.get(config.kind, 0) + 1
        try:
            for _ in range(min(EPISODE_OPS, ops - done)):
                op = gen.draw(ep)
                log.append(op)
                ep.execute(op)
                done += 1
                if progress and done * 100 // ops != shown:
                    shown = done * 100 // ops
                    rate = done / (time.perf_counter() - start)
                    print(f"\rsoak {_bar(done / ops)} {done:,}/{ops:,} ops, {rate:,.0f} ops/s", end="", file=sys.stderr)
            ep.finish()
        except Violation:
            if progress:
                print(file=sys.stderr)
            small, message, lines = shrink(config, log, patch, shrink_s)
            seconds = time.perf_counter() - start
            found = ["m.check_invariants()  # raises"] if message.startswith("check_invariants") else []
            repro = ["from pagedkv.core import *", "pins = []", *lines, *found, f"# violation: {message}"]
            return SoakResult(done, seed, seconds, done / seconds, 1, episodes, by_kind, failed + ep.failed_calls,
                              message, repro)  # fmt: skip
        failed += ep.failed_calls
        loaded += ep.tier_blocks_loaded
    if progress:
        print(file=sys.stderr)
    seconds = time.perf_counter() - start
    return SoakResult(done, seed, seconds, done / seconds if seconds else 0.0, 0, episodes, by_kind, failed,
                      tier_blocks_loaded=loaded)  # fmt: skip


def _bar(frac: float, width: int = 30) -> str:
    n = int(frac * width)
    return "[" + "#" * n + "." * (width - n) + "]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", type=int, default=1_000_000, help="operations to run (default 1,000,000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--policy", default="lru", metavar="NAME[,NAME]",
        help="eviction policies the paged episodes draw from: lru, slru, lfu, priority, cost, or all (default lru)",
    )  # fmt: skip
    p.add_argument("--partial-reuse", action="store_true", help="half the paged episodes copy partially matching blocks")
    p.add_argument("--tiers", action="store_true",
                   help="half the paged episodes keep a host tier below the device and fetch blocks from it")  # fmt: skip
    p.add_argument("--hybrid", type=int, default=0, metavar="OPS",
                   help="then OPS operations on hybrid managers (KV cache groups; pagedkv.bench.soak_hybrid)")  # fmt: skip


def _policies(text: str) -> tuple[str, ...]:
    from pagedkv.core.eviction import EVICTION_POLICIES

    names = tuple(EVICTION_POLICIES) if text == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in EVICTION_POLICIES]
    if bad or not names:
        raise InvalidArgumentError(f"--policy: unknown eviction policy {bad or text!r}; choose from "
                                   f"{', '.join(EVICTION_POLICIES)} or all")  # fmt: skip
    return names


def run(args: argparse.Namespace) -> int:
    if args.ops < 1:
        raise InvalidArgumentError(f"--ops must be >= 1, got {args.ops}")
    result = run_soak(args.ops, args.seed, progress=not args.no_progress and args.ops >= 50_000,
                      policies=_policies(args.policy), partial_reuse=args.partial_reuse, tiers=args.tiers)  # fmt: skip
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(result.episodes_by_kind.items()))
        print(f"soak: {result.ops:,} ops (seed {result.seed}) in {result.seconds:.1f} s: {result.ops_per_s:,.0f} ops/s; "
              f"{result.episodes} episodes ({kinds}); {result.failed_calls:,} failed calls checked; "
              f"violations: {result.violations}")  # fmt: skip
        if result.reproduction:
            print(f"violation: {result.message}\nreproduction:")
            print("\n".join(result.reproduction))
    return 0 if result.violations == 0 and _run_hybrid(args) else 1


def _run_hybrid(args: argparse.Namespace) -> bool:
    """`--hybrid OPS`: the hybrid managers' soak after the main one; True when it found nothing."""
    if not getattr(args, "hybrid", 0):
        return True
    from pagedkv.bench.soak_hybrid import run_hybrid_soak

    r = run_hybrid_soak(args.hybrid, args.seed)
    print(json.dumps(asdict(r)) if args.json else f"soak (hybrid): {r.ops:,} ops in {r.episodes} episodes, "
          f"{r.seconds:.1f} s; violations: {r.violations}{' (' + r.message + ')' if r.message else ''}")  # fmt: skip
    return r.violations == 0
