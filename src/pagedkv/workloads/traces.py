"""Readers for real request traces, and the token synthesis every benchmark shares.

Two formats, one record type:

- Azure LLM inference trace 2023 (CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`). No token content: each
  prompt is made of tokens unique to its request. Patel et al., "Splitwise", ISCA 2024 (CC-BY 4.0).
- Mooncake FAST'25 traces (JSONL: `timestamp` ms, `input_length`, `output_length`, `hash_ids`). `hash_ids`
  name 512-token prefix blocks: two requests whose lists start with the same k ids share exactly their first
  k*512 prompt tokens. Qin et al., "Mooncake", FAST 2025 (Apache-2.0).

Token synthesis (the one the peer harnesses in benchmarks/allocator_vs_peers.py use, so prefix hit rates
compare across allocators):
`tok(stream, key, j) = sm64(sm64(sm64(0) ^ stream ^ (key << 8)) + j) % 50000`, stream 0 for Azure prompts
(key = row index), 1 for generated tokens (key = row index, j = output position), 2 for Mooncake blocks
(key = hash id, j = position inside the 512-token block), 3 for Mooncake padding (key = row index,
j = position in the prompt) when a row's length exceeds what its hash ids cover.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError

MOONCAKE_BLOCK_TOKENS = 512
# A row longer than this is a broken row, not a long prompt (the longest contexts are ~10M tokens).
MAX_TRACE_TOKENS = 1 << 27
VOCAB = 50_000
STREAM_AZURE_PROMPT, STREAM_GENERATED, STREAM_MOONCAKE_BLOCK, STREAM_MOONCAKE_PAD = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. `arrival_s` is relative to the trace's first request."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None


def default_trace_path() -> Path:
    """The Azure conv trace shipped inside the package (gzip CSV), for a user's first run."""
    return Path(str(resources.files("pagedkv.data").joinpath("azure_conv_2023.csv.gz")))


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115 - closed by the caller's `with`


def _positive(value: object, what: str, where: str, *, allow_zero: bool = False) -> int:
    try:
        number = int(str(value))
    except ValueError:
        raise InvalidArgumentError(f"{where}: {what} must be an integer, got {value!r}") from None
    if number < 0 or (number == 0 and not allow_zero):
        raise InvalidArgumentError(f"{where}: {what} must be {'>= 0' if allow_zero else '> 0'}, got {number}")
    if number > MAX_TRACE_TOKENS:  # checked before anything is sized from it
        raise InvalidArgumentError(
            f"{where}: {what} {number:,} is beyond any model's context (at most {MAX_TRACE_TOKENS:,} tokens)"
        )
    return number


def _read_azure(path: Path, limit: int | None) -> Iterator[TraceRequest]:
    with _open_text(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        expected = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None:
            raise InvalidArgumentError(f"{path}: empty file (expected the Azure header {','.join(expected)})")
        if [h.strip() for h in header[:3]] != expected:
            raise InvalidArgumentError(f"{path}:1: expected the Azure header {','.join(expected)}, got {header}")
        t0: datetime | None = None
        for index, row in enumerate(reader):
            if limit is not None and index >= limit:
                return
            where = f"{path}:{index + 2}"
            if len(row) < 3:
                raise InvalidArgumentError(f"{where}: expected 3 columns, got {len(row)}: {row}")
            try:
                stamp = datetime.fromisoformat(row[0].strip()[:26])
            except ValueError:
                raise InvalidArgumentError(f"{where}: bad TIMESTAMP {row[0]!r}") from None
            t0 = stamp if t0 is None else t0
            yield TraceRequest(
                index=index,
                arrival_s=(stamp - t0).total_seconds(),
                prompt_len=_positive(row[1], "ContextTokens", where),
                # Some real rows generate nothing; the loop still needs one step, so count at least one token.
                output_len=max(1, _positive(row[2], "GeneratedTokens", where, allow_zero=True)),
            )


def _json_row(line: str, where: str) -> dict[str, object]:
    """One JSONL row as an object; a malformed line is one readable line naming the file and line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InvalidArgumentError(f"{where}: not a Mooncake trace row (a JSON object per line)")
    return obj


def _read_mooncake(path: Path, limit: int | None) -> Iterator[TraceRequest]:
    with _open_text(path) as f:
        t0: float | None = None
        index = 0
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if limit is not None and index >= limit:
                return
            where = f"{path}:{line_no}"
            obj = _json_row(line, where)
            try:
                stamp, hash_ids = float(obj["timestamp"]), obj["hash_ids"]
                prompt_len, output_len = obj["input_length"], obj["output_length"]
            except KeyError as e:
                raise InvalidArgumentError(f"{where}: not a Mooncake trace row (no {e.args[0]!r} field)") from None
            except (ValueError, TypeError, OverflowError):
                raise InvalidArgumentError(f"{where}: not a Mooncake trace row (timestamp {obj['timestamp']!r})") from None
            if not isinstance(hash_ids, list) or not all(isinstance(h, int) and h >= 0 for h in hash_ids):
                raise InvalidArgumentError(f"{where}: hash_ids must be a list of non-negative ints")
            t0 = stamp if t0 is None else t0
            yield TraceRequest(
                index=index,
                arrival_s=(stamp - t0) / 1000.0,
                prompt_len=_positive(prompt_len, "input_length", where),
                output_len=max(1, _positive(output_len, "output_length", where, allow_zero=True)),
                hash_ids=tuple(hash_ids),
            )
            index += 1


def load_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """Read an Azure CSV (optionally .gz) or Mooncake JSONL trace; errors name the file and line."""
    path = Path(path)
    if limit is not None and limit < 0:
        raise InvalidArgumentError(f"limit must be >= 0, got {limit}")
    if not path.is_file():
        raise InvalidArgumentError(f"trace file not found: {path}")
    name = path.name.removesuffix(".gz")
    if name.endswith(".csv"):
        rows = list(_read_azure(path, limit))
    elif name.endswith((".jsonl", ".json")):
        rows = list(_read_mooncake(path, limit))
    else:
        raise InvalidArgumentError(f"{path}: unknown trace format (expected .csv, .csv.gz or .jsonl)")
    if not rows and limit != 0:
        raise InvalidArgumentError(f"{path}: the trace holds no requests")
    return rows


# --- token synthesis --------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def sm64(x: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser of (x + golden) mod 2^64, vectorised."""
    with np.errstate(over="ignore"):  # arithmetic is mod 2^64 by definition
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return np.asarray(z ^ (z >> np.uint64(31)), dtype=np.uint64)


_SM64_ZERO = int(sm64(0))


def synth_tokens(stream: int, key: int, positions: npt.ArrayLike) -> npt.NDArray[np.int32]:
    """`tok(stream, key, j)` for every j in `positions`."""
    with np.errstate(over="ignore"):
        seed = sm64(np.uint64(_SM64_ZERO ^ stream ^ ((key << 8) & 0xFFFFFFFFFFFFFFFF)))
        return (sm64(seed + np.asarray(positions, dtype=np.uint64)) % np.uint64(VOCAB)).astype(np.int32)


def prompt_token_ids(request: TraceRequest) -> npt.NDArray[np.int32]:
    """The synthetic prompt of a trace request (Azure: private tokens; Mooncake: shared per hash id)."""
    n = request.prompt_len
    if request.hash_ids is None:
        return synth_tokens(STREAM_AZURE_PROMPT, request.index, np.arange(n))
    tokens = _mooncake_blocks(request.hash_ids, n)
    if len(tokens) >= n:
        return tokens[:n]
    pad = synth_tokens(STREAM_MOONCAKE_PAD, request.index, np.arange(len(tokens), n))
    return np.concatenate([tokens, pad])


def _mooncake_blocks(hash_ids: tuple[int, ...], n: int) -> npt.NDArray[np.int32]:
    """The tokens of the blocks `hash_ids` name (only as many blocks as `n` tokens need): `synth_tokens` of
    stream 2 for every block in one vectorised pass."""
    used = np.array(hash_ids[: -(-n // MOONCAKE_BLOCK_TOKENS)], dtype=np.uint64)
    if not len(used):
        return np.zeros(0, dtype=np.int32)
    with np.errstate(over="ignore"):
        keys = (used << np.uint64(8)) ^ np.uint64(_SM64_ZERO ^ STREAM_MOONCAKE_BLOCK)
        seeds = sm64(keys)
        positions = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)
        return (sm64(seeds[:, None] + positions[None, :]).reshape(-1) % np.uint64(VOCAB)).astype(np.int32)


def generated_token_ids(request: TraceRequest, start: int, stop: int) -> npt.NDArray[np.int32]:
    """Synthetic output tokens [start, stop) of a request: private to it."""
    return synth_tokens(STREAM_GENERATED, request.index, np.arange(start, stop))
