"""The command line's shared vocabulary: argument types that refuse bad values in one line, the flags
several commands share (declared once here), the one `SchedulerConfig` builder, and size checks against the
machine before anything is allocated.

Every `pagedkv` command builds its parser from these, so a flag means the same thing, takes the same values
and fails the same way everywhere: `--block-size 0` is `pagedkv <command>: error: argument --block-size:
expected an integer >= 1, got '0'` (one line, exit status 2) in `plan`, `simulate`, `generate` and every
benchmark. Old spellings stay as hidden aliases (`--max-batched-tokens` for `--max-num-batched-tokens`).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.engine.speculative.config import SpeculativeConfig, parse_speculative
from pagedkv.workloads.traces import MAX_TRACE_TOKENS

# Far beyond any model's context (the longest are ~10M tokens): a length past this is a typo, refused
# before anything is sized from it (the trace reader's bound, one number for both).
MAX_TOKENS = MAX_TRACE_TOKENS


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer <= {maximum:,}, got {text!r}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
token_count = int_at_least(1, MAX_TOKENS)  # a length in tokens
seed_int = int_at_least(0, 2**63 - 1)


def float_in(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] ((low, high] with `low_open`)."""
    bracket = "(" if low_open else "["

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
        if not ok:
            hi = "inf)" if math.isinf(high) else f"{high:g}]"
            raise argparse.ArgumentTypeError(f"expected a number in {bracket}{low:g}, {hi}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


positive_float = float_in(0.0, low_open=True)
nonnegative_float = float_in(0.0)
fraction = float_in(0.0, 1.0, low_open=True)


def byte_size(text: str) -> int:
    """An argparse type: a byte size such as 64MiB, 2GB or 1TiB (more than zero)."""
    from pagedkv.engine.config import parse_bytes

    try:
        value = parse_bytes(text)
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size above zero, got {text!r}")
    return value


def existing_file(text: str) -> Path:
    """An argparse type: a file that exists and can be read."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: not readable")
    return path


def output_file(*suffixes: str) -> Callable[[str], Path]:
    """An argparse type: a file to write, with one of `suffixes`, in a folder that exists and is writable."""

    def parse(text: str) -> Path:
        path = Path(text)
        if suffixes and path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text}: expected a {' or '.join(suffixes)} file name")
        folder = path.parent if str(path.parent) else Path(".")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text}: folder {folder} does not exist or is not writable")
        return path

    parse.__name__ = "output file"
    return parse


def writable_folder(text: str) -> str:
    """An argparse type: a folder a file can be written in (created if missing, as the tier would)."""
    import tempfile

    try:
        Path(text).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=text):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: not a writable folder ({e.strerror})") from None
    return text


def add_block_size(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: int = 16) -> None:
    """`--block-size`, the one declaration every command shares."""
    parser.add_argument(
        "--block-size", type=int_at_least(1, 1 << 16), default=default,
        help=f"tokens per KV block (default: {default})",
    )  # fmt: skip


def add_kv_cache_dtype(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--kv-cache-dtype` and `--kv-scale-scheme`, the one declaration of how K/V are stored
    (`EngineConfig.kv_cache_dtype` and `kv_scale_scheme`, the planner's and the simulator's KV bytes)."""
    from pagedkv.storage.kv_spec import KV_CACHE_DTYPES, KV_SCALE_SCHEMES

    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
        help="how K/V are stored: auto (the model's dtype), bf16, or one byte per value with float32 scales "
        "(see --kv-scale-scheme): int8, fp8_e4m3, fp8_e5m2 (docs/quantized-kv.md)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-scale-scheme", choices=KV_SCALE_SCHEMES, default="token",
        help="scales of a quantized --kv-cache-dtype: one per token and KV head (token, the default) or one per "
        "block and KV head (block: 2x the tokens of bf16 in one budget)",
    )  # fmt: skip


def default_threads() -> int:
    """The cores this process may run on (its CPU affinity), the default of every `--threads`."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def add_threads(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--threads`, the one declaration every command that runs a model shares: torch's intra-op threads."""
    parser.add_argument(
        "--threads", type=int_at_least(1, 4096), default=None,
        help="torch threads for the model's forward (default: the cores this process may use, shared "
        "evenly by the processes that run a model side by side)",
    )  # fmt: skip


def add_linear_backend(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--linear-backend`: the projections' implementation on a CPU (pagedkv.hf.cpu_linear), and
    `--batch-invariant`, which picks batch-invariant mode's own ("invariant": `EngineConfig.batch_invariant`)."""
    parser.add_argument(
        "--linear-backend", choices=("auto", "onednn", "torch"), default="auto",
        help="the model's projections on a CPU: onednn (weights packed once; faster, not bit-identical to "
        "transformers in float32), torch (nn.Linear), auto (onednn for bf16 weights on a CPU with bf16 "
        "instructions, else torch)",
    )  # fmt: skip
    parser.add_argument(
        "--batch-invariant", dest="linear_backend", action="store_const", const="invariant",
        help="batch-invariant mode: a request's tokens and logprobs are bit-identical whatever else is in its "
        "batch, however its prompt is chunked and whether its prefix came from the cache (Llama-structured "
        "models; slower: docs/rl.md)",
    )  # fmt: skip


def speculative_setting(text: str) -> SpeculativeConfig:
    """An argparse type: a speculative decoding setting (`ngram:k=4`, `draft:PATH,k=3`), `parse_speculative`'s
    text form."""
    try:
        return parse_speculative(text)
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_speculative(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--speculative`, the one declaration every command that serves a model shares (`EngineConfig.speculative`,
    docs/speculative.md)."""
    parser.add_argument(
        "--speculative", type=speculative_setting, default=None, metavar="SPEC",
        help="speculative decoding: ngram:k=4 (prompt lookup; options min=, max=, off_above=) or draft:MODEL,k=3 "
        "(a smaller model with the same tokenizer; option off_above=) (default: off; docs/speculative.md)",
    )  # fmt: skip


def use_threads(num_threads: int | None, *, share: int = 1) -> int:
    """Run torch's forward on `num_threads` threads (None: this process's cores divided by `share`, the
    processes that run a model side by side, at least one); return the count in use."""
    import torch

    n = num_threads if num_threads is not None else max(1, default_threads() // max(1, share))
    torch.set_num_threads(n)
    return n


def add_scheduler_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, defaults: SchedulerConfig | None = None,
    *, preemption: bool = False,
) -> None:  # fmt: skip
    """The scheduler's flags (batch limit, token budget, growth reserve, the shared-prefix hold, optionally
    preemption), with the defaults of `defaults` (the engine's `SchedulerConfig()` unless a command models
    another scheduler)."""
    d = defaults or SchedulerConfig()
    parser.add_argument(
        "--max-num-seqs", type=positive_int, default=d.max_num_seqs,
        help=f"most requests running at once (default: {d.max_num_seqs})",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=d.max_num_batched_tokens,
        dest="max_num_batched_tokens", help=f"token budget per step (default: {d.max_num_batched_tokens})",
    )  # fmt: skip
    # the older spelling of `pagedkv generate` and `bench e2e`, kept working but not advertised
    parser.add_argument(
        "--max-batched-tokens", type=positive_int, dest="max_num_batched_tokens", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--admission-lookahead", type=nonnegative_int, default=d.admission_lookahead,
        help="growth reserve: admission keeps free the blocks each running request needs for this many more "
        f"tokens (default: {d.admission_lookahead}; 0 = greedy)",
    )  # fmt: skip
    parser.add_argument(
        "--hold-shared-prefix", action=argparse.BooleanOptionalAction, default=d.hold_shared_prefix,
        help="hold a waiting request back one step when a request admitted in the same step computes its first "
        f"uncached block, so that it hits that block instead of computing it again (default: "
        f"{'on' if d.hold_shared_prefix else 'off'})",
    )  # fmt: skip
    if preemption:
        parser.add_argument(
            "--preemption", choices=("recompute", "swap"), default=d.preemption_mode,
            help="what a preempted request does with its blocks: recompute (free them, re-queue) or swap "
            f"(copy them to host memory) (default: {d.preemption_mode})",
        )  # fmt: skip


def scheduler_from(args: argparse.Namespace, **overrides: object) -> SchedulerConfig:
    """The `SchedulerConfig` the scheduler flags describe: the one builder every command uses."""
    fields: dict[str, object] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "admission_lookahead": args.admission_lookahead,
    }
    if getattr(args, "hold_shared_prefix", None) is not None:
        fields["hold_shared_prefix"] = args.hold_shared_prefix
    if getattr(args, "preemption", None) is not None:
        fields["preemption_mode"] = args.preemption
    fields.update(overrides)
    return SchedulerConfig(**fields)  # type: ignore[arg-type]


def available_memory_bytes() -> int | None:
    """Memory the machine can still give this process (MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_memory(num_bytes: int, what: str, fix: str) -> None:
    """Refuse (one line) to allocate `num_bytes` for `what` where the machine has less memory available."""
    free = available_memory_bytes()
    if free is not None and num_bytes > free:
        raise InvalidArgumentError(
            f"{what} needs {num_bytes / 2**30:,.1f} GiB but this machine has {free / 2**30:,.1f} GiB available; {fix}"
        )


class OneLineParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line (`pagedkv plan: error: ...`, exit status 2), like the
    commands' own; `--help` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
