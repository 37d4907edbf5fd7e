"""The allocator's cost against an older commit in instructions, which a busy machine does not blur.

    python benchmarks/allocator_instructions.py record calls.pkl              # with this tree's pagedkv
    python benchmarks/allocator_instructions.py compare calls.pkl TREE [TREE...]

`record` runs `pagedkv bench allocator`'s loop (Azure conv, 3,000 requests, 16,384 blocks of 16 tokens, at
most 256 running, sha256 keys, the default LRU policy) once and saves every call it makes to the manager
(`admit`, `mark_computed`, `append`, `preempt`, `free`, with their arguments and results). `compare` replays
those calls, under valgrind's callgrind, against the pagedkv of each TREE (a checkout with its C extension
built: `git worktree add /tmp/old <commit> && (cd /tmp/old && python setup.py build_ext --inplace)`), once
with the replay and once without it, and prints the instructions of the replay alone (the difference).
Each replay asserts that every call returns what it returned when recorded, so the trees do the same work.

On a shared 2-core machine, interleaved wall-clock pairs of `pagedkv bench allocator` spread +-20% from pair
to pair; instruction counts repeat to the instruction. They are not time: valgrind hides the x86 SHA
instructions, so the SHA-256 of block keys runs in portable C and weighs several times what it does natively
(it is the same in every tree: `--exclude-sha` prints the counts without it as well). Both figures belong in
a comparison (docs/cache-policy.md has them).
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

_REPLAY = r"""
import pickle, sys
import numpy as np
from pagedkv.core import BlockKeys
from pagedkv.engine.managers import make_manager

calls = pickle.load(open(sys.argv[1], "rb"))
if sys.argv[2] == "replay":
    m = make_manager("paged", 16384, 16, enable_prefix_caching=True, hash_fn="sha256")
    keys, seq = {}, {}
    for c in calls:
        op = c[0]
        if op == "append":
            assert m.append(np.array([seq[s] for s in c[1].tolist()], np.int64), c[2]) == c[3]
        elif op == "mark":
            m.mark_computed(np.array([seq[s] for s in c[1].tolist()], np.int64))
        elif op == "admit":
            k = keys.get(c[3])
            if k is None:
                k = keys[c[3]] = BlockKeys()
            r = m.admit(c[1], max_new_tokens=c[2], keys=k)
            assert (r is None) == (c[4] is None), "the replay diverged from the recording"
            if r is not None:
                seq[c[4]] = r.seq_id
        elif op == "preempt":
            m.preempt(seq[c[1]])
        else:
            m.free(seq[c[1]])
"""


def record(path: Path) -> None:
    """Run the bench's loop once with a manager that logs its calls."""
    from pagedkv.bench import allocator
    from pagedkv.workloads.traces import default_trace_path, load_trace

    calls: list[tuple[Any, ...]] = []
    make = allocator.make_manager

    class Logged:
        def __init__(self, m: Any) -> None:
            self._m, self._ids = m, {}

        def __getattr__(self, name: str) -> Any:
            return getattr(self._m, name)

        def admit(self, tokens: Any, *, max_new_tokens: int = 0, keys: Any = None) -> Any:
            kid = self._ids.setdefault(id(keys), len(self._ids))
            r = self._m.admit(tokens, max_new_tokens=max_new_tokens, keys=keys)
            calls.append(("admit", tokens.copy(), max_new_tokens, kid, None if r is None else r.seq_id))
            return r

        def mark_computed(self, seq_ids: Any) -> None:
            calls.append(("mark", np.array(seq_ids, dtype=np.int64)))
            self._m.mark_computed(seq_ids)

        def append(self, seq_ids: Any, tokens: Any) -> bool:
            ok = self._m.append(seq_ids, tokens)
            calls.append(("append", np.array(seq_ids, dtype=np.int64), np.array(tokens), ok))
            return bool(ok)

        def preempt(self, seq_id: int) -> int:
            calls.append(("preempt", int(seq_id)))
            return int(self._m.preempt(seq_id))

        def free(self, seq_id: int) -> None:
            calls.append(("free", int(seq_id)))
            self._m.free(seq_id)

    allocator.make_manager = lambda *a, **k: Logged(make(*a, **k))
    paged = allocator._Loop.__init__

    def init(loop: Any, *a: Any, **k: Any) -> None:
        paged(loop, *a, **k)
        loop.paged = True  # the loop keys requests for a PagedKVManager; the logger stands in for one

    allocator._Loop.__init__ = init  # type: ignore[method-assign]
    result = allocator.replay(load_trace(default_trace_path())[:3000], "paged")
    with open(path, "wb") as f:
        pickle.dump(calls, f)
    print(f"{len(calls)} calls, {result.steps} steps, {result.preemptions} preemptions -> {path}")


def _instructions(tree: Path, calls: Path, mode: str, out: Path) -> dict[str, int]:
    """Instructions per function (callgrind, no cache simulation) of one run of the replay script."""
    script = out.with_suffix(".py")
    script.write_text(_REPLAY)
    # a fixed hash seed: str/bytes hashing (the prefix index's dict) otherwise moves the count by ~0.2% a run
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PYTHONHASHSEED": "0"}
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--cache-sim=no", sys.executable,
         str(script), str(calls), mode],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(out)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    counts = {"total": 0, "sha": 0}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)", line)
        if not m:
            continue
        n = int(m.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in m.group(2):
            counts["total"] = n
        elif "sha_compress" in m.group(2):
            counts["sha"] += n
    return counts


def compare(calls: Path, trees: list[Path], exclude_sha: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for tree in trees:
            full = _instructions(tree, calls, "replay", Path(tmp) / "full.out")
            base = _instructions(tree, calls, "load", Path(tmp) / "base.out")
            replay = full["total"] - base["total"]
            line = f"{tree}: {replay / 1e9:.3f} G instructions"
            if exclude_sha:
                line += f", {(replay - full['sha'] + base['sha']) / 1e9:.3f} G without SHA-256"
            print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("calls", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("calls", type=Path)
    c.add_argument("trees", type=Path, nargs="+")
    c.add_argument("--exclude-sha", action="store_true")
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.calls)
    else:
        compare(args.calls, args.trees, args.exclude_sha)


if __name__ == "__main__":
    main()
