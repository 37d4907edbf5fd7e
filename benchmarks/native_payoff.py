"""What each C function of `pagedkv.core._native` buys, side by side in one process.

    PYTHONPATH=src python benchmarks/native_payoff.py [--trace PATH] [--limit N] [--repeats 3] [--verify-hits]

Replays a trace through the paged allocator (`pagedkv bench allocator`'s loop: 16,384 blocks of 16 tokens,
at most 256 running, sha256 keys) with the hot-path backend built from the C extension except one function
taken from the Python specification (`hotpath.PythonBackend`), for each of the eight functions, and with all
C and all Python; the configurations run interleaved, `--repeats` times, and the median us/token is
printed with its ratio to all C. A ratio above 1 is what keeping that function in C buys. `--verify-hits`
replays with `verify_hits=True`, the configuration where publishing goes through `publish_rows`.
The schedules are identical in every configuration (the backends are interchangeable); only time differs.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from pagedkv.bench import allocator
from pagedkv.core import PagedKVManager, hotpath
from pagedkv.workloads.traces import default_trace_path, load_trace

FUNCTIONS = ("match", "publish_rows", "forget_keys", "check_rows", "growth", "grow", "publish_computed", "take_live", "release_refs")


class Mixed:
    """A backend: the C extension's functions, except `in_python` taken from the Python specification."""

    def __init__(self, native: Any, in_python: tuple[str, ...]) -> None:
        self.NAME = "mixed"
        for name in FUNCTIONS:
            setattr(self, name, getattr(hotpath.PYTHON if name in in_python else native, name))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=None, help="Azure CSV(.gz) or Mooncake JSONL (default: shipped Azure conv)")
    p.add_argument("--limit", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--verify-hits", action="store_true")
    args = p.parse_args()
    native = hotpath.NATIVE
    if native is None:
        raise SystemExit("the C extension is not built (python setup.py build_ext --inplace)")
    requests = load_trace(args.trace or default_trace_path(), limit=args.limit)
    if args.verify_hits:
        allocator.make_manager = lambda name, num_blocks, block_size, **kw: PagedKVManager(  # type: ignore[assignment,misc]
            num_blocks, block_size, hash_fn=kw["hash_fn"], verify_hits=True, native=kw["native"]
        )
    configs = {"all C": Mixed(native, ()), "all Python": Mixed(native, FUNCTIONS)}
    configs |= {f"{name} in Python": Mixed(native, (name,)) for name in FUNCTIONS}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, backend in configs.items():
            hotpath.NATIVE = backend  # type: ignore[assignment]
            result = allocator.replay(
                requests, "paged", num_blocks=16384, block_size=16, max_running=256, prefix_caching=True,
                hash_fn="sha256", trace_name="", native=None,
            )  # fmt: skip
            times[name].append(result.us_per_token)
    hotpath.NATIVE = native
    base = statistics.median(times["all C"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<28} {median:.4f} us/token  {median / base:.2f}x all C")


if __name__ == "__main__":
    main()
