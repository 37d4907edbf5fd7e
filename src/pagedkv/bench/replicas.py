"""`pagedkv bench replicas`: the same multi-turn requests through three request routers on Ray Serve.

    pagedkv bench replicas [--replicas 2] [--conversations 160] [--turns 6] [--concurrency 32] [--repeat 3]
                           [--routers pagedkv,prefix-affinity,pow2] [--model small|tiny] [--quick] [--json OUT]

One local Ray cluster; for each router in turn a fresh application of N replicas (a seeded CPU model,
`--model`: `small` by default, 3.2M parameters, whose prefill time grows with the tokens it computes as a real
replica's does, or `tiny`, the test model, where a forward is mostly fixed cost and TTFT measures overheads;
`--num-blocks` blocks of 4 tokens) and the same seeded trace: `--conversations` chats of `--turns` turns, conversation c opening with system prompt
c % `--systems` (shared across conversations), every turn's prompt = the whole history (previous prompts and
the model's actual answers) + a new user message. `--concurrency` conversations run at once (the first ones
start together, before any replica holds a system prompt; each later one starts when one ends), each turn
sent when the previous one has answered (closed loop). `--quick`: 32 conversations, all at once (about 200
requests, 3 s a router; TTFT p99 there is the burst's tail, noise between rounds). Requests go through the
replicas' Ray handle, so the router under test decides each one. Routers: `pagedkv` (PagedKVRequestRouter, fed
by KV events), `prefix-affinity` (Ray's PrefixCacheAffinityRouter, a text prefix tree of what it routed),
`pow2` (Ray's default). Rounds are interleaved: round k starts with router k mod 3. Every router's replicas
run the same engine configuration; `--no-hold-shared-prefix` turns the scheduler's shared-prefix hold off in
all of them (and in the simulator), and the output prints the setting.

Per router and round: prefix hit rate (cached prompt tokens / prompt tokens, as the engines report them; also
for first turns alone, and the share of later turns served where the previous turn was), TTFT p50/p99 (send
to first streamed output, in this process), throughput (output tokens / wall time), imbalance (most requests
on one replica / the mean), the 1-minute load average before and after; medians over the rounds. The output
names every router setting (its class, the arguments it was given and its defaults) and the machine. Then the
simulator (`pagedkv.sim.replicas`, the same `CostRouting` code as the live router) replays the pagedkv rounds'
requests (their prompts and answers, each conversation starting when it started here, the same turn
structure and block size) over the same number of replicas and predicts its hit rate. The simulator's KV
cache (an H100's) never evicts; here a replica's `--num-blocks` 2048 hold the full histories (about 55 blocks
each) of about 37 conversations, so the default 160-conversation trace (about 8,800 blocks) evicts on 2 and
on 4 replicas, and `--quick`'s 32 conversations do not.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import inspect
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.cli_args import add_threads
from pagedkv.router.policy import LIVE_WEIGHTS, CostRouting, CostWeights

BLOCK_SIZE = 4
VOCAB_LOW, VOCAB_HIGH = 3, 128  # the tiny model's vocabulary, without pad/bos/eos


# The replicas' model (`--model`), seeded random weights from a config, the same in every replica and for every
# router. `tiny` (hidden 64, 2 layers): a forward is mostly fixed cost (prefill of 150 tokens 1.9 ms against
# 1.3 ms for 30, one torch thread here), so TTFT measures Ray's and the router's overheads, not the prefill a
# cache hit saves. `small` (hidden 256, 4 layers, 3.2M parameters): prefill grows with the tokens computed
# (13.5 ms for 150 tokens, 5.6 ms for 30; a decode step of 16 sequences 4.0 ms), as on a real replica, so a
# router's hits show in its TTFT.
BENCH_MODELS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4},
}  # fmt: skip


def bench_model(name: str) -> Any:
    """The replicas' model `name` (`BENCH_MODELS`): a Llama with seed-0 weights, vocabulary 128, EOS 2."""
    if name not in BENCH_MODELS:
        raise InvalidArgumentError(f"unknown bench model {name!r}; choose one of {', '.join(BENCH_MODELS)}")
    import torch
    import transformers as tf

    from pagedkv.hf.tiny import VOCAB

    config = tf.LlamaConfig(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            max_position_embeddings=2048, **BENCH_MODELS[name])  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).eval()


def bench_engine(
    num_blocks: int, remote_url: str | None, *, hold_shared_prefix: bool = True, model: str = "tiny",
    threads: int | None = None, replicas: int = 1,
) -> Any:
    """A replica's engine: the seeded bench `model` with `num_blocks` blocks of 4 tokens, KV events on, the
    engine's default scheduler but for `hold_shared_prefix` (the same for every router); `threads` torch
    threads (None: the machine's cores shared evenly by the `replicas`)."""
    from pagedkv.engine.cli_args import use_threads
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.scheduler import SchedulerConfig

    use_threads(threads, share=replicas)
    config = EngineConfig(
        num_blocks=num_blocks, block_size=BLOCK_SIZE, kv_events=True, remote_url=remote_url,
        scheduler=SchedulerConfig(hold_shared_prefix=hold_shared_prefix),
    )  # fmt: skip
    return Engine(bench_model(model), None, config)


@dataclass(frozen=True)
class TraceSpec:
    conversations: int = 160
    turns: int = 6
    systems: int = 4
    system_len: int = 64
    user_len: tuple[int, int] = (6, 14)
    output_len: int = 16
    seed: int = 0
    concurrency: int = 32  # conversations in flight at once

    def __post_init__(self) -> None:
        names = ("conversations", "turns", "systems", "system_len", "output_len", "concurrency")
        bad = [f"--{n.replace('_', '-')} {getattr(self, n)}" for n in names if getattr(self, n) < 1]
        if bad:
            raise InvalidArgumentError(f"these must be >= 1: {', '.join(bad)}")

    def build(self) -> list[list[list[int]]]:
        """Per conversation: its system prompt + first user message, then each later turn's user message."""
        rng = np.random.default_rng(self.seed)
        systems = [rng.integers(VOCAB_LOW, VOCAB_HIGH, self.system_len).tolist() for _ in range(self.systems)]
        out = []
        for c in range(self.conversations):
            users = [rng.integers(VOCAB_LOW, VOCAB_HIGH, int(rng.integers(*self.user_len))).tolist()
                     for _ in range(self.turns)]  # fmt: skip
            out.append([systems[c % self.systems] + users[0], *users[1:]])
        return out


QUICK = {"conversations": 32, "concurrency": 32}  # `--quick`: last session's trace, every conversation at once
FIGURES = ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "tokens_per_s", "imbalance")


@dataclass
class Turn:
    conversation: int
    turn: int
    replica: str
    prompt: list[int]
    output: list[int]
    cached: int
    ttft_s: float
    sent_s: float = 0.0  # from the run's start


def _hit_rate(turns: list[Turn]) -> float:
    prompt = sum(len(t.prompt) for t in turns)
    return sum(t.cached for t in turns) / prompt if prompt else 0.0


@dataclass
class RouterRun:
    router: str
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    load: tuple[float, float] = (math.nan, math.nan)  # 1-minute load average before and after the run
    decisions: dict[str, float] = field(default_factory=dict)  # pagedkv's: counts and ranking time
    replicas: int = 0  # replicas deployed (those that served nothing count too)

    def summary(self) -> dict[str, Any]:
        ttft = np.array([t.ttft_s for t in self.turns])
        per: dict[str, int] = {}
        for t in self.turns:
            per[t.replica] = per.get(t.replica, 0) + 1
        counts = sorted(per.values(), reverse=True)
        counts += [0] * (self.replicas - len(counts))
        where = {(t.conversation, t.turn): t.replica for t in self.turns}
        later = [t for t in self.turns if t.turn > 0]
        stayed = sum(where.get((t.conversation, t.turn - 1)) == t.replica for t in later)
        return {
            "router": self.router, "requests": len(self.turns), "prefix_hit_rate": _hit_rate(self.turns),
            "first_turn_hit_rate": _hit_rate([t for t in self.turns if t.turn == 0]),
            "stayed": stayed / len(later) if later else 1.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tokens_per_s": sum(len(t.output) for t in self.turns) / self.wall_s if self.wall_s else 0.0,
            "requests_per_replica": counts, "imbalance": counts[0] / (sum(counts) / len(counts)),
            "wall_s": self.wall_s, "load_1min": list(self.load), "router_decisions": self.decisions,
        }  # fmt: skip


async def _conversation(
    handle: Any, c: int, turns: list[list[int]], output_len: int, run: RouterRun, start: float
) -> None:
    from pagedkv.engine.params import SamplingParams
    from pagedkv.serve.replica_calls import ReplicaRequest

    history: list[int] = []
    for k, user in enumerate(turns):
        prompt = history + user
        sent = time.perf_counter()
        first: float | None = None
        final = None
        where = ""
        gen = handle.options(stream=True).generate.remote(
            ReplicaRequest(prompt, SamplingParams(max_new_tokens=output_len, ignore_eos=True))
        )
        async for replica, out in gen:
            where = replica
            first = first if first is not None else time.perf_counter() - sent
            if out.finished:
                final = out
        if final is None or first is None:
            raise InvalidArgumentError(f"conversation {c} turn {k}: the replica ended without an answer")
        output = list(final.output_token_ids)
        run.turns.append(Turn(c, k, where, prompt, output, final.num_cached_tokens, first, sent - start))
        history = prompt + list(final.output_token_ids)


async def _drive(handle: Any, trace: list[list[list[int]]], spec: TraceSpec, router: str) -> RouterRun:
    """Every conversation, at most `spec.concurrency` at once, started in order (the semaphore is FIFO)."""
    run = RouterRun(router)
    gate = asyncio.Semaphore(spec.concurrency)
    start = time.perf_counter()

    async def one(c: int, turns: list[list[int]]) -> None:
        async with gate:
            await _conversation(handle, c, turns, spec.output_len, run, start)

    await asyncio.gather(*(one(c, turns) for c, turns in enumerate(trace)))
    run.wall_s = time.perf_counter() - start
    run.turns.sort(key=lambda t: (t.conversation, t.turn))
    return run


async def _warm_up(handle: Any, replicas: int) -> None:
    """Every replica answers (Ray has them all) and has run a forward (first-call costs out of the figures)."""
    from pagedkv.engine.params import SamplingParams
    from pagedkv.serve.replica_calls import ReplicaRequest

    seen: set[str] = set()
    for i in range(200):
        rid, _ = await handle.whoami.remote()
        seen.add(rid)
        if len(seen) >= replicas and i >= 2 * replicas:
            break
    for i in range(2 * replicas):
        gen = handle.options(stream=True).generate.remote(
            ReplicaRequest([2 + i % 2] * 3, SamplingParams(max_new_tokens=2, ignore_eos=True))
        )
        async for _ in gen:
            pass


STATS_PERIOD_S = 0.5


def router_kwargs(router: str, args: argparse.Namespace) -> dict[str, Any]:
    """The arguments a router is given here (every other setting is its class's default)."""
    return dataclasses.asdict(weights(args)) if router == "pagedkv" else {}


def router_settings(router: str, args: argparse.Namespace) -> dict[str, Any]:
    """What decides a router's behaviour: its class, what it is given and its defaults (for the output)."""
    from pagedkv.serve.ray_app import router_class

    cls = router_class(router)
    params = inspect.signature(cls.initialize_state).parameters.values()
    defaults = {p.name: _plain(p.default) for p in params if p.default is not inspect.Parameter.empty}
    given = router_kwargs(router, args)
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "given": given, "effective": {**defaults, **given}}


def _decisions(handle: Any) -> dict[str, float]:
    """The handle's pagedkv router's counts (decisions, load-imbalance fallbacks, requests Ray placed elsewhere
    than the first of their ranking) and its time ranking (`ranking_ms`, in this process, beside the callers),
    read through Ray's private attributes (2.60): empty for Ray's routers or another Ray."""
    from pagedkv.serve.ray_ingress import ray_request_router

    router = ray_request_router(handle)
    live = getattr(router, "live", None)
    if live is None:
        return {}
    return {
        "decisions": int(router.decisions), "fallbacks": int(router.fallbacks),
        "displaced": int(getattr(router, "displaced", 0)),
        "ranking_ms": round(1e3 * float(getattr(router, "busy_s", 0.0)), 1),
    }  # fmt: skip


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def measure(
    router: str, args: argparse.Namespace, spec: TraceSpec, trace: list[list[list[int]]], port: int, k: int = 0
) -> RouterRun:
    """One router's run of the trace on a fresh application, named for its round: Ray shares a request router
    between handles to the same deployment in one process, and a router must not carry one round's state
    (an index, a prefix tree) into the next."""
    from pagedkv.serve.ray_app import ReplicaSet, running

    replicas = ReplicaSet(
        replicas=args.replicas, remote_url=args.remote_url,
        engine=functools.partial(
            bench_engine, args.num_blocks, hold_shared_prefix=_hold(args), model=args.model,
            threads=args.threads, replicas=args.replicas,
        ),
        router=router, num_cpus=args.replica_cpus, stats_period_s=STATS_PERIOD_S,
        router_kwargs=router_kwargs(router, args),
    )  # fmt: skip
    with running(replicas, port=port, app_name=f"bench-{router}-{k}") as app:
        asyncio.run(_warm_up(app.replicas, args.replicas))
        time.sleep(1.0)  # routing stats (the replicas' event endpoints) reach this process's handle
        before = os.getloadavg()[0]
        run = asyncio.run(_drive(app.replicas, trace, spec, router))
        run.replicas = args.replicas
        run.load = (before, os.getloadavg()[0])
        run.decisions = _decisions(app.replicas)
        print(f"  {router}: {_round_line(run.summary())}", flush=True)
        return run


def _hold(args: argparse.Namespace) -> bool:
    """`--hold-shared-prefix`: the replicas' scheduler setting, and the simulator's."""
    return bool(getattr(args, "hold_shared_prefix", True))


def predict(run: RouterRun, args: argparse.Namespace) -> dict[str, Any]:
    """The simulator's hit rate for the same requests over the same replicas under the cost policy."""
    from pagedkv.sim.catalog import Catalog
    from pagedkv.sim.replicas import ReplicaSimulation, TierConfig
    from pagedkv.sim.simulator import SIM_SCHEDULER, SimConfig
    from pagedkv.sim.workload import Workload, WorkloadSpec
    from pagedkv.workloads.generators import GeneratedRequest

    requests: list[GeneratedRequest] = []
    previous: dict[int, int] = {}
    for t in run.turns:  # sorted by (conversation, turn); a first turn arrives when it was sent here
        index = len(requests)
        parent = previous.get(t.conversation)
        arrival = t.sent_s if parent is None else 0.0
        requests.append(GeneratedRequest(index, arrival, np.asarray(t.prompt, dtype=np.int32),
                                         np.asarray(t.output, dtype=np.int32), parent, 0.0))  # fmt: skip
        previous[t.conversation] = index
    catalog = Catalog.builtin()
    config = SimConfig(
        catalog.model("smollm2-135m"), catalog.gpu("h100"), block_size=BLOCK_SIZE, max_model_len=2048,
        scheduler=dataclasses.replace(SIM_SCHEDULER, hold_shared_prefix=_hold(args)),
    )
    workload = Workload(WorkloadSpec(source="multi-turn", num_requests=len(requests)), requests, 0, 0)
    tiers = TierConfig(remote_tier=args.remote_url is not None)
    sim = ReplicaSimulation(config, workload, num_replicas=args.replicas, router="cost", tiers=tiers)
    sim.router.policy = CostRouting(weights(args))  # the live router's weights
    return sim.run()


def weights(args: argparse.Namespace) -> CostWeights:
    """`--cost-weights COMPUTE,LOCAL,REMOTE,QUEUE[,DUPLICATE]` (default: the live router's, `LIVE_WEIGHTS`;
    DUPLICATE left out is the default's, 3)."""
    if not getattr(args, "cost_weights", None):
        return LIVE_WEIGHTS
    try:
        values = [float(x) for x in args.cost_weights.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"--cost-weights takes four or five numbers, got {args.cost_weights!r}") from None
    if len(values) not in (4, 5):
        raise InvalidArgumentError(f"--cost-weights takes four or five numbers, got {args.cost_weights!r}")
    return CostWeights(*values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = TraceSpec()
    p.add_argument("--replicas", type=int, default=2)
    add_threads(p)
    p.add_argument(
        "--routers", default="pagedkv,prefix-affinity,pow2", help="comma-separated, run in this order"
    )
    p.add_argument("--conversations", type=int, default=None, help=f"default {t.conversations} (--quick: 32)")
    p.add_argument("--turns", type=int, default=t.turns)
    p.add_argument(
        "--concurrency", type=int, default=None,
        help=f"conversations in flight at once (default {t.concurrency}; --quick: all)",
    )  # fmt: skip
    p.add_argument(
        "--systems", type=int, default=t.systems, help="system prompts shared by the conversations"
    )
    p.add_argument("--system-len", type=int, default=t.system_len)
    p.add_argument("--output-len", type=int, default=t.output_len)
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--quick", action="store_true", help="32 conversations, all at once (a smoke run)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per replica (4 tokens each)")
    p.add_argument(
        "--model", choices=tuple(BENCH_MODELS), default="small",
        help="the replicas' seeded model: small (3.2M parameters, prefill grows with the tokens computed; "
        "default) or tiny (0.1M, a forward is mostly fixed cost)",
    )  # fmt: skip
    p.add_argument("--remote-url", default=None, help="a shared Redis tier for the replicas")
    p.add_argument("--replica-cpus", type=float, default=0.5)
    p.add_argument(
        "--hold-shared-prefix", action=argparse.BooleanOptionalAction, default=True,
        help="every replica's scheduler holds a request back a step when one admitted in the same step computes "
        "its first uncached block (SchedulerConfig.hold_shared_prefix; default: on, the engine's default)",
    )  # fmt: skip
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: all)")
    p.add_argument(
        "--repeat", type=int, default=1, help="rounds, each starting with the next router (medians)"
    )
    p.add_argument(
        "--cost-weights", default=None, metavar="C,L,R,Q[,D]",
        help="pagedkv's weights: compute, local discount, remote discount, queue, duplicate (default 1,0.1,0.3,1,3: LIVE_WEIGHTS)",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write the figures as JSON to this file")


def trace_spec(args: argparse.Namespace) -> TraceSpec:
    """The trace the flags describe (`--quick` changes only what is not given)."""
    base = TraceSpec(**QUICK) if getattr(args, "quick", False) else TraceSpec()
    return dataclasses.replace(
        base, turns=args.turns, systems=args.systems, system_len=args.system_len, output_len=args.output_len,
        seed=args.seed, conversations=args.conversations or base.conversations,
        concurrency=args.concurrency or base.concurrency,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from pagedkv.serve.ray_app import ROUTERS, free_port

    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not routers:
        raise InvalidArgumentError(f"unknown router(s) {bad or routers}; choose from {', '.join(ROUTERS)}")
    if args.replicas < 1 or args.num_blocks < 16 or args.repeat < 1:
        raise InvalidArgumentError("--replicas and --repeat must be >= 1, --num-blocks >= 16")
    spec = trace_spec(args)
    trace = spec.build()
    weights(args)  # bad weights: one line before Ray starts
    import ray

    machine = {"cpu": _cpu_model(), "cores": os.cpu_count(), "load_1min_start": os.getloadavg()[0]}
    ray.init(
        num_cpus=args.num_cpus, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
    )
    runs: dict[str, list[RouterRun]] = {r: [] for r in routers}
    try:
        port = free_port()
        for k in range(args.repeat):  # interleaved: each round starts with the next router
            print(f"round {k + 1}:", flush=True)
            for router in routers[k % len(routers) :] + routers[: k % len(routers)]:
                runs[router].append(measure(router, args, spec, trace, port, k))
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    machine["load_1min_end"] = os.getloadavg()[0]
    result = summarize(spec, args, runs)
    result["machine"] = machine
    print(_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def summarize(spec: TraceSpec, args: argparse.Namespace, runs: dict[str, list[RouterRun]]) -> dict[str, Any]:
    """Per router the median of each figure over the rounds (and every round); the simulator's prediction
    for each pagedkv round; the settings every router ran with."""
    rows = []
    for router, rounds in runs.items():
        each = [r.summary() for r in rounds]
        row: dict[str, Any] = {k: float(np.median([e[k] for e in each])) for k in FIGURES}
        row.update(
            router=router, rounds=each, requests_per_replica=each[len(each) // 2]["requests_per_replica"],
            settings=router_settings(router, args),
        )  # fmt: skip
        row["hit_rate_range"] = [min(e["prefix_hit_rate"] for e in each), max(e["prefix_hit_rate"] for e in each)]
        rows.append(row)
    common = {"replicas": args.replicas, "replica_cpus": args.replica_cpus, "num_blocks": args.num_blocks,
              "block_size": BLOCK_SIZE, "stats_period_s": STATS_PERIOD_S, "remote_url": args.remote_url,
              "hold_shared_prefix": _hold(args), "model": args.model,
              "model_config": BENCH_MODELS[args.model]}  # fmt: skip
    result: dict[str, Any] = {"trace": asdict(spec), "replicas": args.replicas, "repeat": args.repeat,
                              "common": common, "cost_weights": asdict(weights(args)), "routers": rows}  # fmt: skip
    if runs.get("pagedkv"):
        errors, predicted = [], []
        for ours in runs["pagedkv"]:
            sim = predict(ours, args)["prefix_hit_rate"]
            measured = ours.summary()["prefix_hit_rate"]
            predicted.append(sim)
            errors.append(abs(sim - measured) / measured if measured else float("nan"))
        result["simulator"] = {"router": "cost", "prefix_hit_rate": float(np.median(predicted)),
                               "per_round": predicted, "relative_error": float(np.median(errors)),
                               "relative_errors": errors}  # fmt: skip
    return result


def _round_line(s: dict[str, Any]) -> str:
    lo, hi = s["load_1min"]
    return (
        f"hit {s['prefix_hit_rate']:.1%} (first turns {s['first_turn_hit_rate']:.1%}, stayed {s['stayed']:.1%}), "
        f"TTFT p50 {s['ttft_p50_s'] * 1e3:.1f} ms p99 {s['ttft_p99_s'] * 1e3:.1f} ms, "
        f"{s['tokens_per_s']:.0f} tok/s, {s['requests']} requests {'/'.join(map(str, s['requests_per_replica']))}, "
        f"{s['wall_s']:.1f} s, load {lo:.2f}->{hi:.2f}"
        + "".join(f", {k} {v}" for k, v in s.get("router_decisions", {}).items())
    )


def _table(result: dict[str, Any]) -> str:
    t, m = result["trace"], result.get("machine", {})
    lines = [
        f"{result['replicas']} replicas, {t['conversations']} conversations x {t['turns']} turns, "
        f"{t['concurrency']} at once, {t['systems']} shared system prompts of {t['system_len']} tokens, "
        f"{t['output_len']} output tokens/turn; median of {result['repeat']} interleaved round(s); "
        f"{m.get('cpu', '?')} x {m.get('cores', '?')}, load {m.get('load_1min_start', math.nan):.2f} at the start, "
        f"{m.get('load_1min_end', math.nan):.2f} at the end",
        f"{'router':<16}{'hit rate':>9}{'(range)':>16}{'TTFT p50':>10}{'TTFT p99':>10}{'tok/s':>8}{'imbalance':>10}"
        "  per replica",
    ]
    for r in result["routers"]:
        lo, hi = r["hit_rate_range"]
        lines.append(
            f"{r['router']:<16}{r['prefix_hit_rate']:>9.1%}{f'({lo:.1%}-{hi:.1%})':>16}"
            f"{r['ttft_p50_s'] * 1e3:>8.1f}ms{r['ttft_p99_s'] * 1e3:>8.1f}ms{r['tokens_per_s']:>8.0f}"
            f"{r['imbalance']:>10.2f}  {'/'.join(map(str, r['requests_per_replica']))}"
        )
    for r in result["routers"]:
        lines.append(f"{r['router']} rounds:")
        lines += [f"  {_round_line(e)}" for e in r["rounds"]]
        lines.append(f"  settings: {r['settings']['class']} {json.dumps(r['settings']['effective'])}")
    lines.append(f"every router: {json.dumps(result['common'])}")
    sim = result.get("simulator")
    if sim is not None:
        lines.append(f"simulator (cost policy, the pagedkv rounds' requests): hit rate {sim['prefix_hit_rate']:.1%}, "
                     f"median {sim['relative_error']:.1%} from the measured pagedkv round")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    from pagedkv.engine.cli_args import OneLineParser

    parser = OneLineParser(prog="pagedkv bench replicas")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
