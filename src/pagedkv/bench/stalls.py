"""`pagedkv bench stalls`: step-latency stalls from KV-cache reallocation, measured on this CPU.

A KV cache that grows by reallocating must copy what it holds: transformers' `DynamicCache` concatenates
every step (`torch.cat` of the whole layer cache plus the new token), and a contiguous buffer that doubles
when full copies everything at each doubling. Paged storage never moves a token. This command serves the
same requests, one at a time, greedy, with EOS ignored, through three systems on the same model and one
torch thread:

- `hf-dynamic`: transformers' own forward with `DynamicCache` and its `sdpa` attention;
- `doubling`: the same forward and attention with a cache written for this benchmark (`DoublingLayer`): one
  contiguous `[1, kv_heads, capacity, head_dim]` buffer per layer for K and for V, first sized to the
  prompt rounded up to a power of two (at least `MIN_CAPACITY`), doubled (allocate, copy, drop the old
  one) when a token does not fit;
- `pagedkv-paged`: the pagedkv engine with the paged allocator (one sequence at a time, `max_num_seqs=1`).

Per system it reports decode-step latency p50 / p99 / max, `slow_steps` (decode steps slower than
`SLOW_FACTOR` = 2x that system's median decode step), and `bytes_copied`: the bytes of KV that reallocation
moved; the same latencies in the thread's CPU time (`cpu_*`, `time.thread_time`), which other processes on a
shared machine do not inflate; and `slow_steps_that_copied`. The copy count is observed, not assumed: after every step each layer's K and V tensors are checked, and
when a tensor's storage moved, the bytes it held before the step are counted (a fresh allocation that holds
nothing copies nothing). For pagedkv the storage is checked the same way (it never moves). Prefill steps
are timed and plotted but kept out of the decode statistics. `outputs_identical` says whether the three
produced the same tokens.

`--plot PATH` draws decode-step latency over the run, one panel per system, with the reallocation copies
marked. `--sim` instead replays the same effect at GPU scale in the simulator (`pagedkv.sim`: a
reallocation copies the sequence's KV at the GPU's HBM bandwidth, `SimConfig.realloc`), with no torch.

Timings are wall clock on whatever this machine is doing; the copy counts are exact.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.cli_args import add_threads, int_at_least, output_file, seed_int, use_threads
from pagedkv.progress import Progress

SYSTEMS = ("hf-dynamic", "doubling", "pagedkv-paged")
SLOW_FACTOR = 2.0
MIN_CAPACITY = 16
DEFAULT_PROMPTS = (120, 500)
DEFAULT_OUTPUT = 400
QUICK_PROMPTS = (12, 40)
QUICK_OUTPUT = 40


@dataclass(frozen=True, slots=True)
class StallRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class StepLog:
    """One system's run: per step, its wall time, whether it was a prefill, and the KV bytes it copied."""

    seconds: list[float] = field(default_factory=list)
    prefill: list[bool] = field(default_factory=list)
    copied_bytes: list[int] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)  # the thread's CPU time: blind to other load
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, seconds: float, prefill: bool, copied: int, cpu_seconds: float = float("nan")) -> None:
        self.seconds.append(seconds)
        self.prefill.append(prefill)
        self.copied_bytes.append(copied)
        self.cpu_seconds.append(cpu_seconds)


def next_capacity(length: int) -> int:
    """The smallest power of two >= `length`, at least `MIN_CAPACITY`."""
    cap = MIN_CAPACITY
    while cap < length:
        cap *= 2
    return cap


def slow_steps(decode_seconds: Sequence[float] | np.ndarray, factor: float = SLOW_FACTOR) -> int:
    """Decode steps slower than `factor` x the median decode step."""
    values = np.asarray(decode_seconds, dtype=np.float64)
    if values.size == 0:
        return 0
    return int((values > factor * np.median(values)).sum())


# --- the doubling cache ------------------------------------------------------------------------------


def doubling_cache() -> Any:
    """A transformers `Cache` whose layers are `DoublingLayer`s (built lazily, one per model layer)."""
    from transformers.cache_utils import Cache, DynamicLayer

    class DoublingLayer(DynamicLayer):  # type: ignore[no-untyped-call]
        """Contiguous K/V buffers that double when full; `keys`/`values` are views of the filled part."""

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            super().lazy_initialization(key_states, value_states)
            self._k: Any = None
            self._v: Any = None
            self.length = 0

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            import torch

            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            new = int(key_states.shape[-2])
            end = self.length + new
            if self._k is None or end > self._k.shape[-2]:
                cap = next_capacity(end) if self._k is None else self._k.shape[-2]
                while cap < end:
                    cap *= 2
                shape = (*key_states.shape[:-2], cap, key_states.shape[-1])
                k = torch.empty(shape, dtype=key_states.dtype, device=key_states.device)
                v = torch.empty(shape, dtype=value_states.dtype, device=value_states.device)
                if self.length:  # the reallocation copy
                    k[..., : self.length, :] = self._k[..., : self.length, :]
                    v[..., : self.length, :] = self._v[..., : self.length, :]
                self._k, self._v = k, v
            self._k[..., self.length : end, :] = key_states
            self._v[..., self.length : end, :] = value_states
            self.length = end
            self.keys = self._k[..., :end, :]
            self.values = self._v[..., :end, :]
            return self.keys, self.values

    return Cache(layer_class_to_replicate=DoublingLayer)


class CopyMeter:
    """Counts KV bytes moved by reallocation: a layer tensor whose storage changed since the last look had
    its previous contents copied (unless it held nothing)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, int]] = {}  # slot -> (data_ptr, nbytes)

    def reset(self) -> None:
        self._seen.clear()

    def observe(self, tensors: Sequence[Any]) -> int:
        copied = 0
        for slot, t in enumerate(tensors):
            ptr, nbytes = int(t.data_ptr()), int(t.numel() * t.element_size())
            before = self._seen.get(slot)
            if before is not None and before[0] != ptr:
                copied += before[1]
            self._seen[slot] = (ptr, nbytes)
        return copied


def _layer_tensors(cache: Any) -> list[Any]:
    out = []
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            out += [layer.keys, layer.values]
    return out


# --- the systems -------------------------------------------------------------------------------------


def run_hf(model: Any, requests: Sequence[StallRequest], make_cache: Callable[[], Any]) -> StepLog:
    """Greedy decoding with transformers' forward and `sdpa`, one request at a time, over `make_cache()`."""
    import torch

    model.set_attn_implementation("sdpa")
    log = StepLog()
    meter = CopyMeter()
    with torch.inference_mode():
        for r in requests:
            cache = make_cache()
            meter.reset()
            ids = torch.tensor([r.prompt_token_ids], dtype=torch.long)
            tokens: list[int] = []
            prefill = True
            while len(tokens) < r.output_len:
                start, cpu = time.perf_counter(), time.thread_time()
                out = model(input_ids=ids, cache=cache, use_cache=True)
                tok = int(out.logits[0, -1].argmax())
                dt, dcpu = time.perf_counter() - start, time.thread_time() - cpu
                log.add(dt, prefill, meter.observe(_layer_tensors(cache)), dcpu)
                tokens.append(tok)
                ids = torch.tensor([[tok]], dtype=torch.long)
                prefill = False
            log.outputs.append(tokens)
    return log


def run_paged(model: Any, requests: Sequence[StallRequest], block_size: int = 16) -> StepLog:
    """The pagedkv engine, paged allocator, one sequence at a time; each `step()` timed."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.engine.scheduler import SchedulerConfig

    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    config = EngineConfig(
        num_blocks=-(-longest // block_size) + 2,
        block_size=block_size,
        scheduler=SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=max(512, max(len(r.prompt_token_ids) for r in requests))
        ),
        enable_prefix_caching=False,
    )
    engine = Engine(model, None, config)
    log = StepLog()
    meter = CopyMeter()
    storage = engine.cache.storage.data
    meter.observe([storage])
    rids = []
    for i, r in enumerate(requests):
        rid = f"s{i}"
        rids.append(rid)
        params = SamplingParams(max_new_tokens=r.output_len, ignore_eos=True)
        engine.add_request(r.prompt_token_ids, params, request_id=rid)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        before = engine.stats.num_scheduled_tokens
        start, cpu = time.perf_counter(), time.thread_time()
        finished = engine.step()
        dt, dcpu = time.perf_counter() - start, time.thread_time() - cpu
        scheduled = engine.stats.num_scheduled_tokens - before
        log.add(dt, scheduled > 1, meter.observe([engine.cache.storage.data]), dcpu)
        for out in finished:
            outputs[out.request_id] = list(out.output_token_ids)
    log.outputs = [outputs[rid] for rid in rids]
    return log


# --- figures -----------------------------------------------------------------------------------------


def summarize(log: StepLog) -> dict[str, Any]:
    """Decode-step latency percentiles, slow steps, bytes copied (see the module docstring)."""
    secs = np.asarray(log.seconds)
    is_decode = ~np.asarray(log.prefill, dtype=bool)
    decode = secs[is_decode] if secs.size else secs
    cpu = np.asarray(log.cpu_seconds)[is_decode] if secs.size else secs
    copies = np.asarray(log.copied_bytes, dtype=np.int64)
    copying = (copies > 0)[is_decode] if secs.size else copies > 0
    slow = decode > SLOW_FACTOR * np.median(decode) if decode.size else copying
    cpu_ok = cpu.size and np.isfinite(cpu).all()
    return {
        "decode_steps": int(decode.size),
        "prefill_steps": int(secs.size - decode.size),
        "step_p50_ms": float(np.median(decode) * 1e3) if decode.size else None,
        "step_p99_ms": float(np.percentile(decode, 99) * 1e3) if decode.size else None,
        "step_max_ms": float(decode.max() * 1e3) if decode.size else None,
        "slow_steps": slow_steps(decode),
        "slow_steps_that_copied": int((slow & copying).sum()),
        "cpu_p50_ms": float(np.median(cpu) * 1e3) if cpu_ok else None,
        "cpu_p99_ms": float(np.percentile(cpu, 99) * 1e3) if cpu_ok else None,
        "cpu_max_ms": float(cpu.max() * 1e3) if cpu_ok else None,
        "cpu_slow_steps": slow_steps(cpu) if cpu_ok else None,
        "copying_step_cpu_ms": float(np.mean(cpu[copying]) * 1e3) if cpu_ok and copying.any() else None,
        "bytes_copied": int(copies.sum()),
        "reallocating_steps": int((copies > 0).sum()),
        "total_s": float(secs.sum()),
    }


def plot_logs(logs: dict[str, StepLog], path: str | Path, title: str) -> Path:
    """Decode-step latency over the run, one panel per system; steps that copied KV marked in red."""
    from pagedkv.sim.figures import pyplot, save_figure

    plt = pyplot()

    fig, axes = plt.subplots(len(logs), 1, figsize=(11, 2.4 * len(logs) + 0.8), sharex=True, squeeze=False)
    for ax, (name, log) in zip(axes[:, 0], logs.items()):
        ms = np.asarray(log.seconds) * 1e3
        keep = ~np.asarray(log.prefill, dtype=bool)
        x = np.arange(len(ms))
        copied = np.asarray(log.copied_bytes) > 0
        ax.plot(x[keep], ms[keep], lw=0.6, color="tab:blue", label="decode step (wall)")
        cpu_ms = np.asarray(log.cpu_seconds) * 1e3
        ax.plot(x[keep], cpu_ms[keep], lw=0.6, color="tab:orange", label="same step, thread CPU time")
        ax.scatter(x[keep & copied], ms[keep & copied], s=10, color="tab:red", zorder=3, label="copied KV")
        s = summarize(log)
        if s["step_p50_ms"] is not None:
            ax.axhline(SLOW_FACTOR * s["step_p50_ms"], color="grey", ls="--", lw=0.7, label="2x median")
        ax.set_title(
            f"{name}: p50 {s['step_p50_ms'] or 0:.1f} ms, p99 {s['step_p99_ms'] or 0:.1f} ms, "
            f"max {s['step_max_ms'] or 0:.1f} ms, {s['slow_steps']} slow (CPU time: p50 "
            f"{s['cpu_p50_ms'] or 0:.1f}, max {s['cpu_max_ms'] or 0:.1f} ms, {s['cpu_slow_steps']} slow), "
            f"{s['bytes_copied'] / 2**20:.1f} MiB copied",
            fontsize=9,
            loc="left",
        )
        ax.set_ylabel("ms")
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("step (prefill steps omitted)")
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


# --- the same effect at GPU scale ---------------------------------------------------------------------

SIM_RUNS = (  # (label, allocator, SimConfig.realloc)
    ("contiguous-reserved", "contiguous-oracle", "none"),
    ("contiguous-doubling", "contiguous-oracle", "doubling"),
    ("contiguous-concat", "contiguous-oracle", "concat"),
    ("paged", "paged", "none"),
)


def simulate_stalls(
    model: str = "llama-2-7b", gpu: str = "a100-80gb", num_requests: int = 200
) -> dict[str, tuple[dict[str, Any], Any]]:
    """Replay the first `num_requests` Azure conv requests (burst) per `SIM_RUNS` entry; per label the
    figures (decode-only steps: no more tokens scheduled than requests running) and the `SimTrace`."""
    from pagedkv.sim.catalog import Catalog
    from pagedkv.sim.run_metrics import summarize as sim_summary
    from pagedkv.sim.simulator import SimConfig, simulate
    from pagedkv.sim.workload import WorkloadSpec, build_workload

    catalog = Catalog.builtin()
    base = SimConfig(model=catalog.model(model), gpu=catalog.gpu(gpu))
    wl = build_workload(WorkloadSpec(num_requests=num_requests, arrivals="burst"), base.max_model_len)
    out: dict[str, tuple[dict[str, Any], Any]] = {}
    for label, allocator, realloc in SIM_RUNS:
        config = SimConfig(model=base.model, gpu=base.gpu, allocator=allocator, realloc=realloc)
        trace = simulate(config, wl)
        secs = np.asarray(trace.step_s)
        decode = secs[np.asarray(trace.batched_tokens) <= np.asarray(trace.running)]
        copy = np.asarray(trace.realloc_s)
        summary = sim_summary(trace)
        out[label] = (
            {
                "allocator": allocator,
                "realloc": realloc,
                "decode_steps": int(decode.size),
                "step_p50_ms": float(np.median(decode) * 1e3),
                "step_p99_ms": float(np.percentile(decode, 99) * 1e3),
                "step_max_ms": float(decode.max() * 1e3),
                "slow_steps": slow_steps(decode),
                "bytes_copied": float(trace.realloc_bytes),
                "copy_share_of_time": float(copy.sum() / secs.sum()),
                "copy_max_ms": float(copy.max() * 1e3) if copy.size else 0.0,
                "reallocating_steps": int((copy > 0).sum()),
                "requests_per_s": summary["requests_per_s"],
                "tpot_p99_ms": summary["tpot_p99_s"] * 1e3,
            },
            trace,
        )
    return out


def run_sim(args: argparse.Namespace) -> int:
    results = simulate_stalls(args.sim_model, args.gpu, args.num_requests)
    figures = {label: f for label, (f, _) in results.items()}
    data: dict[str, Any] = {
        "model": args.sim_model,
        "gpu": args.gpu,
        "workload": f"azure-conv, first {args.num_requests} requests, all at t=0",
        "slow_factor": SLOW_FACTOR,
        "systems": figures,
    }
    if args.plot:
        from pagedkv.sim.figures import pyplot, save_figure

        plt = pyplot()

        fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.2 * len(results) + 0.8), sharey=True)
        for ax, (label, (f, trace)) in zip(axes, results.items()):
            t = np.asarray(trace.step_end_s)
            ms = np.asarray(trace.step_s) * 1e3
            ax.plot(t, ms, lw=0.5, color="tab:blue", label="step")
            hit = np.asarray(trace.realloc_s) > 0
            ax.scatter(t[hit], ms[hit], s=4, color="tab:red", zorder=3, label="step that copied KV")
            ax.set_title(
                f"{label}: decode p50 {f['step_p50_ms']:.1f} / p99 {f['step_p99_ms']:.1f} / max "
                f"{f['step_max_ms']:.1f} ms, {f['slow_steps']} slow, {f['bytes_copied'] / 1e9:.1f} GB copied, "
                f"{f['requests_per_s']:.2f} req/s",
                fontsize=9,
                loc="left",
            )
            ax.set_ylabel("step (ms)")
            ax.legend(fontsize=7, loc="upper right")
        axes[-1].set_xlabel("simulated time (s)")
        fig.suptitle(f"{args.sim_model} on {args.gpu}: {data['workload']} (simulated)", fontsize=10)
        save_figure(fig, args.plot)
        data["plot"] = str(args.plot)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{args.sim_model} on {args.gpu}, {data['workload']} (simulated; copies at HBM bandwidth)")
    cols = ("step_p50_ms", "step_p99_ms", "step_max_ms", "slow_steps", "bytes_copied", "copy_share_of_time",
            "requests_per_s")  # fmt: skip
    print(f"{'system':<21}" + "".join(f"{c:>19}" for c in cols))
    for label, f in figures.items():
        print(f"{label:<21}" + "".join(f"{f[c]:>19.4g}" for c in cols))
    if args.plot:
        print(f"figure written to {args.plot}")
    return 0


# --- command -----------------------------------------------------------------------------------------


def _load(name: str) -> Any:
    if name.startswith("tiny:"):
        from pagedkv.hf.tiny import tiny_model

        return tiny_model(name.removeprefix("tiny:"))
    from pagedkv.hf.loading import load_model

    return load_model(name)[0]


def build_requests(
    prompt_lens: Sequence[int], output_len: int, vocab: int, seed: int = 0
) -> list[StallRequest]:
    if output_len < 2 or not prompt_lens or min(prompt_lens) < 1:
        raise InvalidArgumentError(
            f"need prompts of >= 1 token and output_len >= 2, got {prompt_lens}, {output_len}"
        )
    rng = np.random.default_rng(seed)
    low = min(3, vocab - 1)
    return [StallRequest(rng.integers(low, vocab, size=n).tolist(), output_len) for n in prompt_lens]


def run_stalls(
    model: Any, requests: Sequence[StallRequest], systems: Sequence[str] = SYSTEMS, progress: bool = False
) -> dict[str, StepLog]:
    """Serve `requests` through each system; the logs, keyed by system."""
    from transformers import DynamicCache

    logs: dict[str, StepLog] = {}
    with Progress("bench stalls", total=len(systems), unit="systems", enabled=None if progress else False) as bar:
        for system in systems:
            bar.update(0, note=system)
            if system == "hf-dynamic":
                logs[system] = run_hf(model, requests, DynamicCache)
            elif system == "doubling":
                logs[system] = run_hf(model, requests, doubling_cache)
            elif system == "pagedkv-paged":
                logs[system] = run_paged(model, requests)
            else:
                raise InvalidArgumentError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
            bar.update(1)
    return logs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2, a folder, a .gguf, or tiny:FAMILY")
    add_threads(parser)
    parser.add_argument(
        "--prompt-lens", type=_lengths, default=list(DEFAULT_PROMPTS), help="comma-separated prompt lengths"
    )
    parser.add_argument(
        "--output-len", type=int_at_least(2, 1 << 20), default=DEFAULT_OUTPUT, help="tokens generated per request"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="subset of " + ",".join(SYSTEMS))
    parser.add_argument("--quick", action="store_true", help="tiny lengths (for tests and smoke runs)")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument(
        "--plot", metavar="PATH", type=output_file(".png"), help="write the step-latency figure (PNG) here"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--sim", action="store_true", help="model the same effect at GPU scale in the simulator instead"
    )
    parser.add_argument("--gpu", default="a100-80gb", help="--sim: GPU (default a100-80gb)")
    parser.add_argument("--sim-model", default="llama-2-7b", help="--sim: model (default llama-2-7b)")
    parser.add_argument(
        "--num-requests", type=int_at_least(1, 100_000), default=200, help="--sim: Azure conv requests (burst)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _lengths(text: str) -> list[int]:
    """`--prompt-lens`: comma-separated token counts, each in [1, 2^20]."""
    parse = int_at_least(1, 1 << 20)
    values = [parse(v.strip()) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated prompt lengths, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    if args.sim:
        return run_sim(args)

    threads = use_threads(args.threads)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = sorted(set(systems) - set(SYSTEMS))
    if bad or not systems:
        raise InvalidArgumentError(
            f"unknown systems {bad or args.systems!r}; choose from {', '.join(SYSTEMS)}"
        )
    prompts = list(args.prompt_lens)
    output_len = args.output_len
    if args.quick:
        prompts, output_len = list(QUICK_PROMPTS), QUICK_OUTPUT
    model = _load(args.model)
    requests = build_requests(prompts, output_len, int(model.config.vocab_size), args.seed)
    logs = run_stalls(model, requests, systems, progress=not args.no_progress)  # on stderr, on a terminal
    figures = {name: summarize(log) for name, log in logs.items()}
    first = next(iter(logs.values())).outputs
    result: dict[str, Any] = {
        "model": args.model,
        "prompt_lens": prompts,
        "output_len": output_len,
        "slow_factor": SLOW_FACTOR,
        "torch_threads": threads,
        "outputs_identical": all(log.outputs == first for log in logs.values()),
        "systems": figures,
    }
    if args.plot:
        title = (
            f"{args.model}: decode-step latency, prompts {prompts}, {output_len} new tokens each, 1 thread"
        )
        result["plot"] = str(plot_logs(logs, args.plot, title))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{args.model}: prompts {prompts}, {output_len} tokens each, one at a time; "
        f"outputs identical: {result['outputs_identical']}"
    )
    cols = ("step_p50_ms", "step_p99_ms", "step_max_ms", "slow_steps", "cpu_p50_ms", "cpu_max_ms", "cpu_slow_steps",
            "bytes_copied", "reallocating_steps")  # fmt: skip
    print(f"{'system':<15}" + "".join(f"{c:>19}" for c in cols))
    for name, f in figures.items():
        cells = "".join(f"{f[c]:>19.2f}" if isinstance(f[c], float) else f"{f[c]!s:>19}" for c in cols)
        print(f"{name:<15}{cells}")
    if args.plot:
        print(f"figure written to {result['plot']}")
    return 0
