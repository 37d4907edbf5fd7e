"""`pagedkv bench rl`: a GRPO-shaped rollout loop on one engine, the way an RL trainer drives it.

Each iteration, as a colocated trainer (verl, slime) runs it:

```
rollout        generate --samples completions of each of --prompts prompts (sampled), once per --sharing mode
stale check    greedy outputs of the engine (prefix cache and host tier warm) == a fresh engine's on the same
               weights, token for token (after the first iteration: the weights were updated in between)
sleep          sleep(--sleep-level): the KV memory (and at level 2 the weights) given back while "training"
train          the weights perturbed (a stand-in for an optimizer step), written to a folder of safetensors
wake_up        the memory taken back (level 2: the weights reloaded from the folder)
update         update_weights(folder, version i+1): no KV of the old weights is served after it
```

The samples of a prompt share its prefill or not, by `--sharing` mode (each one's rollout is timed, the
first one's in the main columns):

- `n`: one request of n samples per prompt (fork + copy-on-write: the prompt computed once);
- `group`: n separate requests of one sample with a shared `group_id` per prompt, as verl sends them
  (`pagedkv.engine.groups`: the group's leader computes the prompt, the others take its full blocks);
- `none`: n separate requests, each with a cache salt of its own: every sample computes its whole prompt.

It prints one row per iteration (rollout tokens/s, the times of update, sleep and wake_up, what sleep gave
back: the allocator's KV bytes, the weights' bytes, the process's RSS), the stale-KV check, and per sharing
mode the rollout tokens/s and the prompt tokens the model computed (tokens run minus decode tokens);
`--json` writes them. Figures from a loaded machine are relative, not a capacity statement.

Batch-invariant mode (`EngineConfig.batch_invariant`; `--batch-invariant` runs the whole loop in it) is
measured last, on the final weights, where the model is Llama-structured: the first sharing mode's rollout
on a default engine and on a batch-invariant one, interleaved `--invariance-rounds` times (tokens/s and the
process's CPU seconds of each; the median ratios are the mode's cost, the CPU one steadier on a shared
machine), and how far each mode's greedy logprobs move between a prompt run
alone and in the rollout's batch (max |difference| over the tokens before the first that differs; the
invariant mode's must be 0).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.engine.cli_args import add_threads, int_at_least, use_threads

SHARING = ("n", "group", "none")


def sharing_modes(text: str) -> list[str]:
    """`--sharing`'s comma-separated modes (see the module docstring), each at most once."""
    modes = [m.strip() for m in text.split(",")]
    if not modes or any(m not in SHARING for m in modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"give distinct modes among {', '.join(SHARING)}, comma-separated; got {text!r}")
    return modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny:llama", help="tiny:FAMILY (seeded random weights), smollm2 or a folder")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's weights")
    parser.add_argument("--prompts", type=int_at_least(1, 4096), default=8, help="prompts per rollout")
    parser.add_argument("--samples", type=int_at_least(1, 256), default=8, help="completions per prompt (GRPO's group)")
    parser.add_argument("--iterations", type=int_at_least(1, 1000), default=4, help="rollout + update rounds")
    parser.add_argument("--max-tokens", type=int_at_least(1, 4096), default=32, help="tokens per completion")
    parser.add_argument("--prompt-len", type=int_at_least(2, 4096), default=48,
                        help="tokens per prompt; the first half is a system prefix every prompt shares")  # fmt: skip
    parser.add_argument("--num-blocks", type=int_at_least(8, 1 << 22), default=512, help="device KV blocks of 16 tokens")
    parser.add_argument("--host-blocks", type=int_at_least(0, 1 << 22), default=256, help="host-tier blocks (0: off)")
    parser.add_argument("--sleep-level", type=int, choices=(1, 2), default=1, help="what sleep releases")
    parser.add_argument("--perturb", type=float, default=0.05, help="weight noise per update, times each tensor's std")
    parser.add_argument("--seed", type=int, default=0, help="prompts, sampling and perturbations")
    parser.add_argument("--sharing", type=sharing_modes, default=list(SHARING),
                        help="how a prompt's samples share its prefill, comma-separated: n (one request of n samples), "
                             "group (n requests with one group_id), none (n requests, no sharing); the first one's "
                             "rollout fills the main columns")  # fmt: skip
    parser.add_argument("--batch-invariant", action="store_true",
                        help="run the loop in batch-invariant mode (docs/rl.md); its cost is measured either way")  # fmt: skip
    parser.add_argument("--invariance-rounds", type=int_at_least(0, 100), default=3,
                        help="interleaved default / batch-invariant rollouts that measure the mode's cost (0: skip)")  # fmt: skip
    add_threads(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the rows and settings as JSON")


def run(args: argparse.Namespace) -> int:
    use_threads(args.threads)
    model = _load(args.model, getattr(args, "dtype", "float32"))
    with tempfile.TemporaryDirectory(prefix="pagedkv-rl-") as folder:
        result = measure(model, args, Path(folder))
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["stale_kv_check"] == "pass" else 1


def _load(name: str, dtype: str) -> Any:
    if name.startswith("tiny:"):
        import torch

        from pagedkv.hf.tiny import tiny_model

        return tiny_model(name.removeprefix("tiny:")).to(getattr(torch, dtype))
    from pagedkv.hf.loading import load_model

    return load_model(name, dtype=dtype, progress=False)[0]


def measure(model: Any, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The loop of the module docstring; rows of figures per iteration."""
    import torch

    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams

    pristine = copy.deepcopy(model)
    invariant = bool(getattr(args, "batch_invariant", False))
    config = EngineConfig(num_blocks=args.num_blocks, block_size=16, host_blocks=args.host_blocks,
                          batch_invariant=invariant)  # fmt: skip
    engine = Engine(model, None, config)  # the default linear backend: oneDNN-packed on most CPUs
    vocab = int(engine.vocab_size)
    rng = np.random.default_rng(args.seed)
    system = rng.integers(3, vocab, size=args.prompt_len // 2).tolist()
    prompts = [system + rng.integers(3, vocab, size=args.prompt_len - len(system)).tolist() for _ in range(args.prompts)]
    greedy = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    weights = _untied(pristine)  # the engine may have packed model's
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[dict[str, Any]] = []
    checks: list[bool] = []
    if args.sleep_level == 2:  # level 2 reloads the weights from a folder: the first one holds version 0
        _save(weights, folder)
        engine.update_weights(folder, version=0, flush_cache=False)  # the same weights: nothing to flush
    for i in range(args.iterations):
        row: dict[str, Any] = {"iteration": i, "weight_version": engine.weight_version}
        row["sharing"] = {mode: _rollout(engine, prompts, args, mode, seed=args.seed + i) for mode in args.sharing}
        row.update(row["sharing"][args.sharing[0]])
        engine.generate(prompts, greedy)  # fills the cache; the checked pass below hits it
        got = [o.output_token_ids for o in engine.generate(prompts, greedy)]
        fresh_model = copy.deepcopy(pristine)
        _load_state(fresh_model, weights)
        want = [o.output_token_ids for o in Engine(fresh_model, None, config).generate(prompts, greedy)]
        row["stale_kv_check"] = "pass" if got == want else "FAIL"
        checks.append(got == want)
        sleep = engine.sleep(args.sleep_level)
        weights = _perturbed(weights, args.perturb, gen)  # "training", while the engine sleeps
        _save(weights, folder)
        wake = engine.wake_up()
        update = engine.update_weights(folder, version=i + 1)
        row.update(sleep_s=sleep.seconds, wake_up_s=wake.seconds, update_s=update.seconds, kv_bytes_freed=sleep.kv_bytes,
                   weight_bytes_freed=sleep.weight_bytes, rss_freed_bytes=sleep.rss_freed_bytes)  # fmt: skip
        rows.append(row)
    engine.close()
    settings = {k: v for k, v in vars(args).items() if k != "json" and isinstance(v, str | int | float | list | None)}
    final = copy.deepcopy(pristine)
    _load_state(final, weights)
    return {"settings": settings, "rows": rows, "stale_kv_check": "pass" if all(checks) else "FAIL",
            "threads": torch.get_num_threads(), "batch_invariance": _invariance(final, prompts, args)}  # fmt: skip


def _invariance(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any] | None:
    """Batch-invariant mode against the default on `model` (module docstring): rollout tokens/s of each
    over interleaved rounds, and each mode's greedy logprob drift between a prompt alone and in the batch;
    None with `--invariance-rounds 0` or where the model is not Llama-structured."""
    from pagedkv.core.errors import InvalidArgumentError
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine

    rounds = int(getattr(args, "invariance_rounds", 0))
    if rounds == 0:
        return None
    engines = {}
    for mode in ("default", "invariant"):
        cfg = EngineConfig(num_blocks=args.num_blocks, block_size=16, batch_invariant=mode == "invariant")
        try:
            engines[mode] = Engine(copy.deepcopy(model), None, cfg)
        except InvalidArgumentError:  # not a model the fused forward runs
            return None
    rates: dict[str, list[float]] = {mode: [] for mode in engines}
    cpu: dict[str, list[float]] = {mode: [] for mode in engines}
    for r in range(rounds):  # interleaved, so that a loaded machine slows both alike
        for mode, engine in engines.items():
            got = _rollout(engine, prompts, args, args.sharing[0], seed=args.seed + 1000 + r)
            rates[mode].append(got["rollout_tok_s"])
            cpu[mode].append(got["rollout_cpu_s"])
    drift = {mode: _logprob_drift(engine, prompts, args.max_tokens) for mode, engine in engines.items()}
    for engine in engines.values():
        engine.close()
    return {"rollout_tok_s": rates, "rollout_cpu_s": cpu, "logprob_drift": drift,
            "cost": _median([d / i for d, i in zip(rates["default"], rates["invariant"], strict=True)]),
            "cpu_cost": _median([i / d for d, i in zip(cpu["default"], cpu["invariant"], strict=True)])}  # fmt: skip


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _logprob_drift(engine: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """The largest |logprob difference| of a greedy token between each prompt alone and all of them in one
    batch, over each output's tokens up to the first that differs (the prefix cache emptied before each)."""
    from pagedkv.engine.params import SamplingParams

    greedy = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, logprobs=0)
    engine.reset_prefix_cache()
    together = engine.generate(prompts, greedy)
    worst = 0.0
    for prompt, batched in zip(prompts, together, strict=True):
        engine.reset_prefix_cache()
        alone = engine.generate([prompt], greedy)[0]
        for a, b, la, lb in zip(alone.output_token_ids, batched.output_token_ids, alone.logprobs or [],
                                batched.logprobs or [], strict=True):  # fmt: skip
            worst = max(worst, abs(la.logprob - lb.logprob))
            if a != b:
                break
    return worst


def _rollout(engine: Any, prompts: list[list[int]], args: argparse.Namespace, mode: str, *, seed: int) -> dict[str, Any]:
    """One rollout of `--samples` completions per prompt, shared by `mode` (module docstring): its seconds,
    tokens, tokens/s, the prompt tokens the model computed and those a group's members took from their
    leader's prefill (`Engine.group_prefill_shared_tokens`)."""
    from pagedkv.engine.params import SamplingParams

    def params(n: int, sample: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0, n=n, seed=seed * 1_000_003 + sample,
                              ignore_eos=True)  # fmt: skip

    engine.reset_prefix_cache()  # every mode starts cold (the same weights: the previous mode's prompts)
    scheduled, shared = int(engine.stats.num_scheduled_tokens), int(engine.group_prefill_shared_tokens)
    started, cpu_started = time.perf_counter(), time.process_time()
    if mode == "n":
        outs = engine.generate(prompts, params(args.samples, 0))
    else:
        ids = [
            engine.add_request(p, params(1, s), group_id=f"rollout-{seed}-{j}" if mode == "group" else None,
                               cache_salt=f"sample-{seed}-{j}-{s}" if mode == "none" else None)
            for j, p in enumerate(prompts) for s in range(args.samples)
        ]  # fmt: skip
        engine.run()
        outs = [engine.output(rid) for rid in ids]
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    tokens = sum(len(o.output_token_ids) for o in outs)
    decode = sum(max(len(o.output_token_ids) - 1, 0) for o in outs)  # each token after a sample's first
    return {"rollout_s": seconds, "rollout_cpu_s": cpu_seconds, "rollout_tokens": tokens, "rollout_tok_s": tokens / seconds,
            "prefix_cached_tokens": sum(o.num_cached_tokens for o in outs),
            "prompt_tokens_computed": int(engine.stats.num_scheduled_tokens) - scheduled - decode,
            "group_shared_tokens": int(engine.group_prefill_shared_tokens) - shared}  # fmt: skip


def _untied(model: Any) -> dict[str, Any]:
    """A copy of `model`'s weights under one name per tensor: a tied one (an `lm_head` that is the input
    embedding) only under its first name, so that a perturbation keeps it tied and a folder holds it once."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            out[name] = tensor.detach().clone()
    return out


def _load_state(model: Any, weights: dict[str, Any]) -> None:
    """`weights` (`_untied`'s names) into `model`; a tied name it left out follows the tensor it shares."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    own = model.state_dict()
    untied = [n for n in missing if not any(own[n].data_ptr() == own[k].data_ptr() for k in weights)]
    assert not unexpected and not untied, f"bench rl: weights do not fit the model: {unexpected or untied}"


def _save(weights: dict[str, Any], folder: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))


def _perturbed(weights: dict[str, Any], scale: float, gen: Any) -> dict[str, Any]:
    import torch

    out = {}
    for name, tensor in weights.items():
        if tensor.is_floating_point() and tensor.numel() > 1:
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32).to(tensor.dtype)
            out[name] = tensor + scale * float(tensor.float().std()) * noise
        else:
            out[name] = tensor
    return out


def render(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"bench rl: {s['model']}, {s['prompts']} prompts x {s['samples']} samples x {s['max_tokens']} tokens, "
        f"{s['iterations']} iterations, sleep level {s['sleep_level']}, host tier {s['host_blocks']} blocks, "
        f"{result['threads']} threads",
        f"{'iter':>4} {'version':>7} {'rollout tok/s':>13} {'rollout s':>9} {'update s':>8} {'sleep s':>7} "
        f"{'wake s':>7} {'KV freed':>10} {'weights freed':>13} {'RSS freed':>10} {'stale KV':>8}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['iteration']:>4} {r['weight_version']:>7} {r['rollout_tok_s']:>13.0f} {r['rollout_s']:>9.2f} "
            f"{r['update_s']:>8.3f} {r['sleep_s']:>7.3f} {r['wake_up_s']:>7.3f} {_mib(r['kv_bytes_freed']):>10} "
            f"{_mib(r['weight_bytes_freed']):>13} {_mib(r['rss_freed_bytes']):>10} {r['stale_kv_check']:>8}"
        )
    lines.append(f"stale-KV check (engine == fresh engine on the same weights, every iteration): {result['stale_kv_check']}")
    lines.append(f"{'sharing':>7} {'rollout tok/s (per iteration)':>40} {'prompt tokens computed':>22}")
    for mode in s["sharing"]:
        rates = " ".join(f"{r['sharing'][mode]['rollout_tok_s']:.0f}" for r in result["rows"])
        computed = result["rows"][0]["sharing"][mode]["prompt_tokens_computed"]
        lines.append(f"{mode:>7} {rates:>40} {computed:>22}")
    inv = result.get("batch_invariance")
    if inv is not None:
        rates = inv["rollout_tok_s"]
        lines.append(
            f"batch-invariant mode ({s['sharing'][0]} rollout, {len(rates['default'])} interleaved rounds): "
            f"{' '.join(f'{x:.0f}' for x in rates['invariant'])} tok/s vs default {' '.join(f'{x:.0f}' for x in rates['default'])}: "
            f"cost {inv['cost']:.2f}x in wall time, {inv['cpu_cost']:.2f}x in CPU time (medians of invariant/default)"
        )
        lines.append(
            "greedy logprob drift, a prompt alone vs in the batch (max |difference|): "
            f"default {inv['logprob_drift']['default']:.3g}, batch-invariant {inv['logprob_drift']['invariant']:.3g}"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="pagedkv bench rl")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
