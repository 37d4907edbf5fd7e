"""What the ingress of `pagedkv serve --replicas N` and its replicas send each other over Ray: a request
(`ReplicaRequest`, which the request routers read too) and the name of one replica for a directed call
(`ReplicaTarget`; the wrong replica refuses it with `WrongReplicaError`)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.params import SamplingParams


@dataclass
class ReplicaRequest:
    """One engine request as the ingress hands it to a replica (and as routers see it)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    group_id: str | None = None  # a sample group's requests prefill their prompt once on the replica they share

    @property
    def prompt(self) -> str:
        """The prompt for text-prefix routers (Ray's PrefixCacheAffinityRouter): one character per token, so
        a shared text prefix is exactly a shared token prefix."""
        return "".join(chr(0x10000 + (t % 0xF0000)) for t in self.prompt_token_ids)


@dataclass(frozen=True)
class ReplicaTarget:
    """Names one replica (Ray's replica unique id) for a directed call (`kv_contents`, `kill`, ...)."""

    replica: str


class WrongReplicaError(InvalidArgumentError):
    """A directed call reached another replica (the named one is gone)."""
