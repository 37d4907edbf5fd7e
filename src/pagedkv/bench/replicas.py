"""`pagedkv bench replicas`: the same multi-turn requests through three request routers on Ray Serve.

    pagedkv bench replicas [--replicas 2] [--conversations 32] [--turns 6] [--repeat 3] [--json OUT]
                           [--routers pagedkv,prefix-affinity,pow2]

One local Ray cluster; for each router in turn a fresh application of N replicas (the tiny CPU model with
`--num-blocks` blocks of 4 tokens, so CPU time goes to routing and caching, not to matmuls) and the same
seeded trace: `--conversations` chats of `--turns` turns, conversation c opening with system prompt
c % `--systems` (shared across conversations), every turn's prompt = the whole history (previous prompts and
the model's actual answers) + a new user message; all conversations run at once, each turn sent when the
previous one has answered (closed loop). Requests go through the replicas' Ray handle, so the router under
test decides each one. Routers: `pagedkv` (PagedKVRequestRouter, fed by KV events), `prefix-affinity`
(Ray's PrefixCacheAffinityRouter, a text prefix tree of what it routed), `pow2` (Ray's default).

Per router: prefix hit rate (cached prompt tokens / prompt tokens, as the engines report them), TTFT p50/p99
(send to first streamed output, in this process), throughput (output tokens / wall time), imbalance (most
requests on one replica / the mean). Then the simulator (`pagedkv.sim.replicas`, the same `CostPolicy` code as
the live router) replays the pagedkv run's requests (their prompts and answers, the same turn structure, same
block size, a KV cache that never evicts, as here) over the same number of replicas and predicts its hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.router.policy import CostPolicy, CostWeights

BLOCK_SIZE = 4
VOCAB_LOW, VOCAB_HIGH = 3, 128  # the tiny model's vocabulary, without pad/bos/eos


def bench_engine(num_blocks: int, remote_url: str | None) -> Any:
    """A replica's engine: the tiny seeded Llama with `num_blocks` blocks of 4 tokens, KV events on."""
    import torch

    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.hf.tiny import tiny_model

    torch.set_num_threads(1)
    config = EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, kv_events=True, remote_url=remote_url)
    return Engine(tiny_model("llama", 0), None, config)


@dataclass(frozen=True)
class TraceSpec:
    conversations: int = 32
    turns: int = 6
    systems: int = 4
    system_len: int = 64
    user_len: tuple[int, int] = (6, 14)
    output_len: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "systems", "system_len", "output_len"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )

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


@dataclass
class Turn:
    conversation: int
    turn: int
    replica: str
    prompt: list[int]
    output: list[int]
    cached: int
    ttft_s: float


@dataclass
class RouterRun:
    router: str
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        prompt = sum(len(t.prompt) for t in self.turns)
        ttft = np.array([t.ttft_s for t in self.turns])
        per: dict[str, int] = {}
        for t in self.turns:
            per[t.replica] = per.get(t.replica, 0) + 1
        counts = sorted(per.values(), reverse=True)
        return {
            "router": self.router, "requests": len(self.turns),
            "prefix_hit_rate": sum(t.cached for t in self.turns) / prompt if prompt else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tokens_per_s": sum(len(t.output) for t in self.turns) / self.wall_s if self.wall_s else 0.0,
            "requests_per_replica": counts, "imbalance": counts[0] / (sum(counts) / len(counts)),
            "wall_s": self.wall_s,
        }  # fmt: skip


async def _conversation(handle: Any, c: int, turns: list[list[int]], output_len: int, run: RouterRun) -> None:
    from pagedkv.engine.params import SamplingParams
    from pagedkv.serve.ray_app import ReplicaRequest

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
        run.turns.append(
            Turn(c, k, where, prompt, list(final.output_token_ids), final.num_cached_tokens, first)
        )
        history = prompt + list(final.output_token_ids)


async def _drive(handle: Any, trace: list[list[list[int]]], output_len: int, router: str) -> RouterRun:
    run = RouterRun(router)
    start = time.perf_counter()
    await asyncio.gather(*(_conversation(handle, c, turns, output_len, run) for c, turns in enumerate(trace)))
    run.wall_s = time.perf_counter() - start
    run.turns.sort(key=lambda t: (t.conversation, t.turn))
    return run


async def _warm_up(handle: Any, replicas: int) -> None:
    """Every replica answers (Ray has them all) and has run a forward (first-call costs out of the figures)."""
    from pagedkv.engine.params import SamplingParams
    from pagedkv.serve.ray_app import ReplicaRequest

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


def measure(router: str, args: argparse.Namespace, trace: list[list[list[int]]], port: int) -> RouterRun:
    from pagedkv.serve.ray_app import ReplicaSet, running

    spec = ReplicaSet(
        replicas=args.replicas, engine=functools.partial(bench_engine, args.num_blocks), remote_url=args.remote_url,
        router=router, num_cpus=args.replica_cpus, stats_period_s=0.5,
        router_kwargs=dataclasses.asdict(weights(args)) if router == "pagedkv" else {},
    )  # fmt: skip
    with running(spec, port=port, app_name=f"bench-{router}") as app:
        asyncio.run(_warm_up(app.replicas, args.replicas))
        time.sleep(1.0)  # routing stats (the replicas' event endpoints) reach this process's handle
        return asyncio.run(_drive(app.replicas, trace, args.output_len, router))


def predict(run: RouterRun, args: argparse.Namespace) -> dict[str, Any]:
    """The simulator's hit rate for the same requests over the same replicas under the cost policy."""
    from pagedkv.sim.catalog import Catalog
    from pagedkv.sim.replicas import ReplicaSimulation, TierConfig
    from pagedkv.sim.simulator import SimConfig
    from pagedkv.sim.workload import Workload, WorkloadSpec
    from pagedkv.workloads.generators import GeneratedRequest

    requests: list[GeneratedRequest] = []
    previous: dict[int, int] = {}
    for t in run.turns:  # sorted by (conversation, turn)
        index = len(requests)
        parent = previous.get(t.conversation)
        requests.append(GeneratedRequest(index, 0.0, np.asarray(t.prompt, dtype=np.int32),
                                         np.asarray(t.output, dtype=np.int32), parent, 0.0))  # fmt: skip
        previous[t.conversation] = index
    catalog = Catalog.builtin()
    config = SimConfig(
        catalog.model("smollm2-135m"), catalog.gpu("h100"), block_size=BLOCK_SIZE, max_model_len=2048
    )
    workload = Workload(WorkloadSpec(source="multi-turn", num_requests=len(requests)), requests, 0, 0)
    tiers = TierConfig(remote_tier=args.remote_url is not None)
    sim = ReplicaSimulation(config, workload, num_replicas=args.replicas, router="cost", tiers=tiers)
    sim.router.policy = CostPolicy(weights(args))  # the live router's weights
    return sim.run()


def weights(args: argparse.Namespace) -> CostWeights:
    """`--cost-weights COMPUTE,LOCAL,REMOTE,QUEUE` (default: the policy's own)."""
    if not getattr(args, "cost_weights", None):
        return CostWeights()
    try:
        values = [float(x) for x in args.cost_weights.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"--cost-weights takes four numbers, got {args.cost_weights!r}") from None
    if len(values) != 4:
        raise InvalidArgumentError(f"--cost-weights takes four numbers, got {args.cost_weights!r}")
    return CostWeights(*values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = TraceSpec()
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--routers", default="pagedkv,prefix-affinity,pow2", help="comma-separated, run in this order"
    )
    p.add_argument("--conversations", type=int, default=t.conversations)
    p.add_argument("--turns", type=int, default=t.turns)
    p.add_argument(
        "--systems", type=int, default=t.systems, help="system prompts shared by the conversations"
    )
    p.add_argument("--system-len", type=int, default=t.system_len)
    p.add_argument("--output-len", type=int, default=t.output_len)
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per replica (4 tokens each)")
    p.add_argument("--remote-url", default=None, help="a shared Redis tier for the replicas")
    p.add_argument("--replica-cpus", type=float, default=0.5)
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: all)")
    p.add_argument(
        "--repeat", type=int, default=1, help="rounds, each starting with the next router (medians)"
    )
    p.add_argument(
        "--cost-weights", default=None, metavar="C,L,R,Q",
        help="pagedkv's weights: compute, local discount, remote discount, queue (default 1,0.1,0.3,1)",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write the figures as JSON to this file")


def run(args: argparse.Namespace) -> int:
    from pagedkv.serve.ray_app import ROUTERS, free_port

    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not routers:
        raise InvalidArgumentError(f"unknown router(s) {bad or routers}; choose from {', '.join(ROUTERS)}")
    if args.replicas < 1 or args.num_blocks < 16 or args.repeat < 1:
        raise InvalidArgumentError("--replicas and --repeat must be >= 1, --num-blocks >= 16")
    spec = TraceSpec(
        args.conversations, args.turns, args.systems, args.system_len, (6, 14), args.output_len, args.seed
    )
    trace = spec.build()
    weights(args)  # bad weights: one line before Ray starts
    import ray

    ray.init(
        num_cpus=args.num_cpus, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
    )
    runs: dict[str, list[RouterRun]] = {r: [] for r in routers}
    try:
        port = free_port()
        for k in range(args.repeat):  # interleaved: each round starts with the next router
            for router in routers[k % len(routers) :] + routers[: k % len(routers)]:
                runs[router].append(measure(router, args, trace, port))
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    result = summarize(spec, args, runs)
    print(_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def summarize(spec: TraceSpec, args: argparse.Namespace, runs: dict[str, list[RouterRun]]) -> dict[str, Any]:
    """Per router the median of each figure over the rounds (and every round); the simulator's prediction
    for each pagedkv round."""
    rows = []
    for router, rounds in runs.items():
        each = [r.summary() for r in rounds]
        row = {k: float(np.median([e[k] for e in each])) for k in ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s",
                                                                 "tokens_per_s", "imbalance")}  # fmt: skip
        row.update(
            router=router, rounds=each, requests_per_replica=each[len(each) // 2]["requests_per_replica"]
        )
        row["hit_rate_range"] = [
            min(e["prefix_hit_rate"] for e in each),
            max(e["prefix_hit_rate"] for e in each),
        ]
        rows.append(row)
    result: dict[str, Any] = {"trace": asdict(spec), "replicas": args.replicas, "repeat": args.repeat,
                              "cost_weights": asdict(weights(args)), "routers": rows}  # fmt: skip
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


def _table(result: dict[str, Any]) -> str:
    t = result["trace"]
    lines = [
        f"{result['replicas']} replicas, {t['conversations']} conversations x {t['turns']} turns, "
        f"{t['systems']} shared system prompts of {t['system_len']} tokens, {t['output_len']} output tokens/turn; "
        f"median of {result['repeat']} interleaved round(s)",
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
