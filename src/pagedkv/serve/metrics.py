"""Prometheus metrics of one server (prometheus-client; names mirror vLLM's with the prefix `pagedkv:`).

Each `ServerMetrics` has its own registry (several servers or Ray replicas in one process never collide);
`GET /metrics` exposes it. Every series carries the label `model_name`.

| metric                                         | kind      | moves when                                        |
|------------------------------------------------|-----------|---------------------------------------------------|
| pagedkv:num_requests_running / waiting / swapped | gauge   | every engine turn (the scheduler's queues)        |
| pagedkv:kv_cache_usage_perc                    | gauge     | every engine turn: blocks held / blocks (0..1)    |
| pagedkv:num_preemptions_total                  | counter   | the engine preempts a request                     |
| pagedkv:prefix_cache_queries_total             | counter   | a request ends: its prompt tokens                 |
| pagedkv:prefix_cache_hits_total                | counter   | a request ends: its prompt tokens served cached   |
| pagedkv:prefix_cache_hits_by_tier_total{tier}  | counter   | the same, by medium (GPU = the device pool)       |
| pagedkv:prefix_cache_miss_tokens_total{reason} | counter   | every engine turn: prompt tokens admitted uncached, by why (pagedkv.core.misses) |
| pagedkv:prompt_tokens_total                    | counter   | a request ends: its prompt tokens (once for n > 1) |
| pagedkv:group_prefill_shared_tokens_total      | counter   | every engine turn: prompt tokens a request of a sample group (`group_id`) took from its leader's prefill instead of computing them |
| pagedkv:generation_tokens_total                | counter   | a request ends: tokens of all its completions     |
| pagedkv:request_success_total{finished_reason} | counter   | a completion ends (stop, length, abort, error)    |
| pagedkv:time_to_first_token_seconds            | histogram | per completion with a token: arrival -> first     |
| pagedkv:time_per_output_token_seconds          | histogram | per completion with 2+ tokens: mean gap           |
| pagedkv:e2e_request_latency_seconds            | histogram | per completion: arrival -> end                    |
| pagedkv:request_queue_time_seconds             | histogram | per completion that was scheduled: arrival -> run |
| pagedkv:spec_decode_num_drafts_total           | counter   | every engine turn: verifications with a draft     |
| pagedkv:spec_decode_num_draft_tokens_total     | counter   | every engine turn: draft tokens verified          |
| pagedkv:spec_decode_num_accepted_tokens_total  | counter   | every engine turn: draft tokens accepted          |
| pagedkv:spec_decode_num_accepted_tokens_per_pos_total{position} | counter | every engine turn: verifications whose drafts 0..position were all accepted |

Every series has a sample from start-up: the counters and histograms of each label value known in advance
(`finished_reason`: each of `pagedkv.engine.request.FINISH_REASONS`; `tier` GPU) start at 0, so a rate over the first
preemption or the first error is never computed against a missing series. Other tiers and the miss
reasons appear (at 0 first) when the engine reports them.

The `spec_decode_` counters are vLLM's (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos{position}`) and exist only when the engine
speculates (`EngineConfig.speculative`), every position 0..k-1 at 0 from its first turn. Derived in PromQL as
vLLM's dashboards do: the acceptance rate is `rate(accepted_tokens) / rate(draft_tokens)`, the rate at a
position `rate(accepted_tokens_per_pos) / rate(drafts)`, the mean accepted length (tokens per verification,
the one the model adds included) `1 + rate(accepted_tokens) / rate(drafts)`.

Counters and histograms are fed by the engine thread when a request's last completion has ended (the
per-request state lives only until then), gauges after every engine turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedkv.engine.request import FINISH_REASONS

if TYPE_CHECKING:
    from pagedkv.engine.outputs import RequestOutput
    from pagedkv.serve.engine_snapshot import EngineSnapshot

PREFIX = "pagedkv:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """The metrics of one server; see the module docstring."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, label, registry=self.registry)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*label, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=self.registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be admitted.")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).")
        self.preemptions = counter("num_preemptions", "Preemptions.")
        self.queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.hits_by_tier = counter("prefix_cache_hits_by_tier", "Prompt tokens served cached, by medium.", ["tier"])
        self.miss_tokens = counter(
            "prefix_cache_miss_tokens", "Prompt tokens admitted without a cache hit, by reason.", ["reason"]
        )
        self._misses_seen: dict[str, int] = {}
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.success = counter("request_success", "Finished completions by reason.", ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to end.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self._preemptions_seen = 0
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Verifications with at least one draft token (vllm:spec_decode_num_drafts)."
        )
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified (vllm:spec_decode_num_draft_tokens)."
        )
        self.spec_accepted = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted (vllm:spec_decode_num_accepted_tokens)."
        )
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Verifications whose drafts up to this position were all accepted "
            "(vllm:spec_decode_num_accepted_tokens_per_pos).",
            ["position"],
        )
        self._spec_seen: tuple[int, int, int, tuple[int, ...]] | None = None
        self.group_shared = counter("group_prefill_shared_tokens", "Prompt tokens not computed because a request "
                                    "of the same sample group (group_id) computed them.")  # fmt: skip
        self._group_shared_seen = 0
        for series in (self.preemptions, self.queries, self.hits, self.prompt_tokens, self.generation_tokens,
                       self.ttft, self.tpot, self.e2e, self.queue, self.group_shared):  # fmt: skip
            series.labels(model_name)  # a sample at 0 from the start
        self.hits_by_tier.labels(model_name, "GPU")
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)

    def observe_engine(self, snapshot: EngineSnapshot) -> None:
        """Gauges (and the preemption counter) from the engine thread's snapshot after a turn."""
        m = self.model_name
        self.running.labels(m).set(snapshot.num_running)
        self.waiting.labels(m).set(snapshot.num_waiting)
        self.swapped.labels(m).set(snapshot.num_swapped)
        self.kv_usage.labels(m).set(snapshot.kv_cache_usage)
        if snapshot.num_preemptions > self._preemptions_seen:
            self.preemptions.labels(m).inc(snapshot.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = snapshot.num_preemptions
        for reason, tokens in snapshot.miss_tokens:
            seen = self._misses_seen.get(reason, 0)
            if tokens > seen or reason not in self._misses_seen:
                self.miss_tokens.labels(m, reason).inc(tokens - seen)  # every reason appears, at 0 at first
                self._misses_seen[reason] = tokens
        if snapshot.group_prefill_shared_tokens > self._group_shared_seen:
            self.group_shared.labels(m).inc(snapshot.group_prefill_shared_tokens - self._group_shared_seen)
            self._group_shared_seen = snapshot.group_prefill_shared_tokens
        if snapshot.spec is not None:
            self._observe_spec(snapshot.spec)

    def _observe_spec(self, spec: tuple[int, int, int, tuple[int, ...]]) -> None:
        """The speculation counters by what the engine's cumulative counts moved since the last turn."""
        m = self.model_name
        drafts, tokens, accepted, per_pos = spec
        drafts0, tokens0, accepted0, per_pos0 = self._spec_seen or (0, 0, 0, (0,) * len(per_pos))
        self.spec_drafts.labels(m).inc(drafts - drafts0)
        self.spec_draft_tokens.labels(m).inc(tokens - tokens0)
        self.spec_accepted.labels(m).inc(accepted - accepted0)
        for pos, (now, before) in enumerate(zip(per_pos, per_pos0)):
            self.spec_accepted_per_pos.labels(m, str(pos)).inc(now - before)  # every position, at 0 first
        self._spec_seen = spec

    def observe_request(self, outputs: Sequence[RequestOutput]) -> None:
        """Counters and histograms of one ended request: its completions' final outputs, parent first."""
        if not outputs:
            return
        m, root = self.model_name, outputs[0]
        self.queries.labels(m).inc(root.num_prompt_tokens)
        self.hits.labels(m).inc(root.num_cached_tokens)
        for tier, tokens in root.num_cached_tokens_by_tier.items():
            if tokens:
                self.hits_by_tier.labels(m, tier).inc(tokens)
        self.prompt_tokens.labels(m).inc(root.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(sum(len(o.output_token_ids) for o in outputs))
        for out in outputs:
            self.success.labels(m, out.finish_reason or "unknown").inc()
            if out.ttft_s is not None:
                self.ttft.labels(m).observe(out.ttft_s)
            if out.tpot_s is not None and len(out.output_token_ids) > 1:
                self.tpot.labels(m).observe(out.tpot_s)
            if out.e2e_s is not None:
                self.e2e.labels(m).observe(out.e2e_s)
            if out.queue_s is not None:
                self.queue.labels(m).observe(out.queue_s)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return bytes(generate_latest(self.registry))
