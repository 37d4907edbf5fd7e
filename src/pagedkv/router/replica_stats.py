"""`ReplicaStats`: the routing message a replica reports (Ray Serve's `record_routing_stats`) and a router reads.

Ray carries routing stats as a dict of plain JSON types: the replica sends `ReplicaStats.as_dict()`, a router
takes `ReplicaStats.from_dict(...)` (an unknown or mistyped field is an `InvalidArgumentError`). Every field
has a default, so a message that says only a load (tests, a replica that publishes no events) is one too.

- `kv_events` / `kv_replay`: the replica's ZMQ event and replay endpoints (None: it publishes none);
  `incarnation` tells a restarted publisher on the same endpoints from the old one;
- `block_size`, `hash_fn`, `epoch`: how the replica names its blocks (`pagedkv.router.request_hashes`);
- `num_blocks`, `free_blocks`: its KV pool;
- `num_running`, `num_waiting`: its load as routers count it (waiting includes what its door accepted);
- `gauges`: the engine's own counts the Ray ingress sums into its `/metrics` (None: not reported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.core.errors import InvalidArgumentError

HASH_FNS = ("sha256", "vllm")


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """One replica's engine counts, as the single server's `/metrics` gauges report them."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_used_blocks: int = 0
    num_blocks: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """A replica's routing message (see the module docstring)."""

    kv_events: str | None = None
    kv_replay: str | None = None
    incarnation: int = 0
    block_size: int = 16
    hash_fn: str = "sha256"
    epoch: int = 0
    num_blocks: int = 0
    free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    gauges: EngineGauges | None = None

    def __post_init__(self) -> None:
        for name in (
            "incarnation",
            "block_size",
            "epoch",
            "num_blocks",
            "free_blocks",
            "num_running",
            "num_waiting",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (name == "block_size"):
                least = 1 if name == "block_size" else 0
                raise InvalidArgumentError(f"routing stats: {name} must be an int >= {least}, got {value!r}")
        if self.hash_fn not in HASH_FNS:
            raise InvalidArgumentError(
                f"routing stats: hash_fn must be one of {HASH_FNS}, got {self.hash_fn!r}"
            )

    @property
    def load(self) -> int:
        """Requests the replica reports in flight (running and waiting)."""
        return self.num_running + self.num_waiting

    def as_dict(self) -> dict[str, Any]:
        """The message as plain JSON types (what Ray carries)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ReplicaStats:
        """The message `as_dict` made (missing fields take their defaults)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidArgumentError(f"routing stats: unknown fields {unknown}; known: {sorted(known)}")
        fields = dict(raw)
        gauges = fields.pop("gauges", None)
        try:
            return cls(**fields, gauges=None if gauges is None else EngineGauges(**gauges))
        except TypeError as err:
            raise InvalidArgumentError(f"routing stats: {err}") from None
