"""Workloads for the simulator: a trace file or a named generator, fitted to `max_model_len`.

Every workload becomes a list of `GeneratedRequest` (explicit prompt and output token ids, an arrival time,
and for multi-turn chats a parent to follow). Requests whose prompt leaves no room for one output token under
`max_model_len` are dropped, and outputs are cut to `max_model_len - prompt_len` (a serving engine would do
the same); both counts are reported.

Arrival modes: `trace` (timestamps honoured, optionally scaled by `time_scale`), `burst` (everything at
t=0: an offline batch, which measures peak throughput), `poisson` (rate given in requests/s).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.workloads import generators as gen
from pagedkv.workloads.generators import GeneratedRequest

GENERATORS = ("variable", "fixed", "shared-prefix", "multi-turn", "legal", "multi-tenant")
LEGAL_ANSWER_ROOM = 512  # legal: contracts are cut to max_model_len minus this, leaving room for the answer
ARRIVALS = ("trace", "burst", "poisson")
DEFAULT_WORKLOAD = "azure-conv"  # the Azure conv trace shipped inside the package


@dataclass(frozen=True)
class WorkloadSpec:
    """What to replay. `source` is a trace path, `azure-conv`, or a generator name."""

    source: str = DEFAULT_WORKLOAD
    num_requests: int = 1000
    arrivals: str = "trace"
    rate: float | None = None
    time_scale: float = 1.0
    seed: int = 0
    prompt_len: int = 512  # fixed-length workload
    output_len: int = 128  # fixed-length workload
    system_prompt_len: int = 1024  # shared-prefix / multi-turn
    turns: int = 4  # multi-turn
    prompt_lognormal: tuple[float, float] | None = (
        None  # variable: (mu, sigma) of ln(prompt); None = Azure fit
    )
    output_lognormal: tuple[float, float] | None = (
        None  # variable: (mu, sigma) of ln(output); None = Azure fit
    )

    def __post_init__(self) -> None:
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise InvalidArgumentError(f"num_requests must be an int >= 1, got {self.num_requests!r}")
        if self.arrivals not in ARRIVALS:
            raise InvalidArgumentError(f"unknown arrival mode {self.arrivals!r}; choose one of {ARRIVALS}")
        if self.arrivals == "poisson" and (self.rate is None or not self.rate > 0):
            raise InvalidArgumentError(f"--arrivals poisson needs --rate > 0 (requests/s), got {self.rate!r}")
        if not self.time_scale > 0:
            raise InvalidArgumentError(f"time_scale must be > 0, got {self.time_scale!r}")
        if isinstance(self.turns, bool) or not isinstance(self.turns, int) or self.turns < 1:
            raise InvalidArgumentError(f"turns must be an int >= 1 (turns per conversation), got {self.turns!r}")
        if self.is_trace and self.source != DEFAULT_WORKLOAD and not Path(self.source).is_file():
            raise InvalidArgumentError(
                f"unknown workload {self.source!r}: not a trace file, nor {DEFAULT_WORKLOAD!r}, "
                f"nor a generator ({', '.join(GENERATORS)})"
            )

    @property
    def is_trace(self) -> bool:
        return self.source == DEFAULT_WORKLOAD or self.source not in GENERATORS

    @property
    def _unit(self) -> str:
        # multi-turn chats start at the rate; their later turns follow their previous turn (closed loop)
        return "conversations/s" if self.source == "multi-turn" else "req/s"

    def describe(self) -> str:
        if self.source == DEFAULT_WORKLOAD:
            name = "azure-conv (Azure LLM inference trace 2023, conv; Patel et al., ISCA 2024)"
        elif self.is_trace:
            name = Path(self.source).name
        elif self.source == "fixed":
            name = f"fixed (prompt {self.prompt_len}, output {self.output_len})"
        elif self.source == "shared-prefix":
            name = f"shared-prefix (system prompt {self.system_prompt_len})"
        elif self.source == "multi-turn":
            name = f"multi-turn ({self.turns} turns)"
        elif self.source == "multi-tenant":
            name = f"multi-tenant (16 system prompts of {self.system_prompt_len}, 40% one-off documents)"
        elif self.source == "legal":
            name = "legal (CUAD-derived contract lengths, Azure conv answer lengths)"
        elif self.prompt_lognormal or self.output_lognormal:
            p = self.prompt_lognormal or gen.AZURE_CONV_PROMPT_LOGNORMAL
            o = self.output_lognormal or gen.AZURE_CONV_OUTPUT_LOGNORMAL
            name = f"variable (ln prompt ~ N({p[0]:g}, {p[1]:g}), ln output ~ N({o[0]:g}, {o[1]:g}))"
        else:
            name = "variable (log-normal fitted to Azure conv)"
        if self.arrivals == "trace":
            how = (
                "trace arrivals" if self.time_scale == 1.0 else f"trace arrivals x{self.time_scale:g} faster"
            )
            if not self.is_trace:
                how = "all at t=0" if self.rate is None else f"Poisson {self.rate:g} {self._unit}"
        elif self.arrivals == "burst":
            how = "all at t=0"
        else:
            how = f"Poisson {self.rate:g} {self._unit}"
        return f"{name}, {self.num_requests} requests, {how}"


@dataclass(frozen=True)
class Workload:
    """Requests ready to replay, and what fitting them to `max_model_len` changed."""

    spec: WorkloadSpec
    requests: list[GeneratedRequest]
    num_dropped: int
    num_clipped: int

    @property
    def name(self) -> str:
        return self.spec.describe()

    def notes(self) -> str:
        return (
            f"{len(self.requests)} requests replayed; {self.num_dropped} dropped (prompt >= max_model_len), "
            f"{self.num_clipped} outputs cut to max_model_len"
        )


def _from_trace(spec: WorkloadSpec, max_model_len: int) -> tuple[list[GeneratedRequest], int]:
    """The trace's requests, and how many were dropped unread: a prompt of max_model_len tokens or more is
    never synthesised (a row may claim billions), and an output only up to one token past the room left."""
    from pagedkv.workloads import traces

    path = traces.default_trace_path() if spec.source == DEFAULT_WORKLOAD else Path(spec.source)
    rows = traces.load_trace(path, limit=spec.num_requests)
    kept = [r for r in rows if r.prompt_len < max_model_len]
    reqs = [
        GeneratedRequest(
            index=r.index,
            arrival_s=r.arrival_s / spec.time_scale,
            prompt_token_ids=traces.prompt_token_ids(r),
            output_token_ids=traces.generated_token_ids(r, 0, min(r.output_len, max_model_len - r.prompt_len + 1)),
        )
        for r in kept
    ]
    return reqs, len(rows) - len(kept)


def _from_generator(spec: WorkloadSpec, max_model_len: int) -> list[GeneratedRequest]:
    n, seed, rate = spec.num_requests, spec.seed, spec.rate if spec.arrivals == "poisson" else None
    if spec.source == "fixed":
        return gen.fixed_length(
            n, prompt_len=spec.prompt_len, output_len=spec.output_len, seed=seed, rate=rate
        )
    if spec.source == "shared-prefix":
        return gen.shared_prefix(n, system_prompt_len=spec.system_prompt_len, seed=seed, rate=rate)
    if spec.source == "multi-turn":
        conversations = max(1, -(-n // spec.turns))
        reqs = gen.multi_turn(
            conversations,
            turns=spec.turns,
            system_prompt_len=spec.system_prompt_len,
            seed=seed,
            rate=rate,
            max_prompt_len=max_model_len - 1,
        )
        return reqs[:n]
    if spec.source == "multi-tenant":
        return gen.multi_tenant(n, system_prompt_len=spec.system_prompt_len, seed=seed, rate=rate,
                                max_prompt_len=max_model_len - 1)  # fmt: skip
    if spec.source == "legal":
        from pagedkv.workloads.legal import legal_contract

        cap = max(1, max_model_len - LEGAL_ANSWER_ROOM)
        return legal_contract(n, seed=seed, rate=rate, max_prompt_len=cap, min_prompt_len=min(256, cap))
    return gen.variable_length(
        n,
        seed=seed,
        rate=rate,
        prompt_lognormal=spec.prompt_lognormal or gen.AZURE_CONV_PROMPT_LOGNORMAL,
        output_lognormal=spec.output_lognormal or gen.AZURE_CONV_OUTPUT_LOGNORMAL,
    )


def build_workload(spec: WorkloadSpec, max_model_len: int) -> Workload:
    """Materialise `spec` and fit it to `max_model_len` (see the module docstring)."""
    reqs, unread = _from_trace(spec, max_model_len) if spec.is_trace else (_from_generator(spec, max_model_len), 0)
    if spec.arrivals == "burst":
        reqs = [replace(r, arrival_s=0.0) for r in reqs]
    elif spec.arrivals == "poisson" and spec.is_trace:  # a trace row's index is its position: times as before
        times = gen.poisson_arrivals(len(reqs) + unread, spec.rate, np.random.default_rng(spec.seed))
        reqs = [replace(r, arrival_s=float(times[r.index])) for r in reqs]
    kept: list[GeneratedRequest] = []
    dropped: set[int] = set()
    clipped = 0
    for r in reqs:
        if r.prompt_len >= max_model_len or (r.parent is not None and r.parent in dropped):
            dropped.add(r.index)
            continue
        room = max_model_len - r.prompt_len
        if r.output_len > room:
            r = replace(r, output_token_ids=r.output_token_ids[:room])
            clipped += 1
        kept.append(r)
    if not kept:
        raise InvalidArgumentError(
            f"no request of workload {spec.source!r} fits max_model_len={max_model_len} "
            f"({len(dropped) + unread} prompts are that long or longer)"
        )
    return Workload(spec, kept, len(dropped) + unread, clipped)
