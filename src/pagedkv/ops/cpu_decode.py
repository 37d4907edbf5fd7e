"""Paged decode attention on a CPU in C (`pagedkv.ops._cpu_decode`), reading the pages in place.

`decode_attention(query, kv, block_table, seq_lens, options)` computes what
`pagedkv.ops.paged_attention` computes for a decode group (one query per sequence, at its last position:
causal, GQA, optional sliding window) without gathering the blocks into a dense tensor first: for each
sequence and KV head the C kernel reads each visible key row once for all query heads that share it, then
the exact softmax (max, exp, sum) and the weighted sum of value rows, in float32. A group of many
sequences is cut across torch's threads, one thread otherwise: inside the C call, as an OpenMP parallel region (the extension is built with `-fopenmp` on Linux and links `libgomp.so.1` by name,
so in a process that imported torch it is torch's own libgomp and the region runs on the team whose threads
torch's GEMMs just used, instead of a Python thread that would have to win a core from them); builds without
OpenMP make one call per part from a pool of Python threads (the GIL released). An x86-64 CPU
with AVX2, FMA and F16C runs a vectorised copy (`isa()`; head sizes that are a multiple of 8, eight keys scored at
once, e^x in eight lanes within 2 ulp of libm's), `set_isa` switches copies (tests compare them).

bfloat16 pages with a bfloat16 query (what `--dtype auto` serves on a CPU with bf16 instructions) run
in the same kernel: each K/V element is widened to float32 in registers as it is read (a bfloat16 is the top
half of a float32, so exactly), the query is widened before the call and the float32 output rounded to the
query's dtype after it, so the answer is the float32 kernel's over the pages upcast to float32, rounded to
bfloat16, with half the page bytes to read.

Quantized pages (int8, fp8 e4m3/e5m2 codes with their `scales`, one per token or one per block and KV head,
`pagedkv.storage.slots`) are read in place too (`scales=`): each element is dequantized in registers as it
is read (the scale indexed by slot, or by block), so the answer is bit-identical to the float32 kernel's over pages holding `code * scale`, with a
quarter of the page bytes to read (`pagedkv bench kv-dtype` compares the page dtypes, docs/quantized-kv.md).

`available(query, kv, scales)` says whether it applies: the extension is built (an optional C extension, like the
allocator's hot path, and off under `PAGEDKV_NATIVE=0`), the tensors are on the CPU, query and pages are both
float32 or both bfloat16, or the query is float32 or bfloat16 over quantized pages with their scales (what a
bfloat16 model over int8 or fp8 KV runs), and no gradient is
wanted (the kernel has no backward). Callers fall back to the SDPA or `pagedkv.ops` path otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.hotpath import load_extension
from pagedkv.ops.options import AttentionOptions

_NATIVE = load_extension("pagedkv.ops._cpu_decode")
# A build with OpenMP splits float32 and bfloat16 decode groups itself (`_cpu_decode.openmp()`).
_OPENMP = _NATIVE is not None and hasattr(_NATIVE, "openmp") and bool(_NATIVE.openmp())
_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}  # how the vector copy converts codes
_LUTS: dict[torch.dtype, torch.Tensor] = {}
# A decode group is cut across torch's threads only where each part gets this many sequences: below it, the
# hand-off to a worker (tens of microseconds) costs more than the part's attention.
MIN_ROWS_PER_THREAD = 4
_POOL: ThreadPoolExecutor | None = None


def _lut(dtype: torch.dtype) -> torch.Tensor:
    """float32 [256]: the value of each one-byte code of `dtype` (before its scale)."""
    lut = _LUTS.get(dtype)
    if lut is None:
        lut = _LUTS[dtype] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().contiguous()
    return lut


def isa() -> str | None:
    """Which compiled copy runs (`"avx2+fma"` or `"generic"`), or None without the extension."""
    return None if _NATIVE is None else str(_NATIVE.isa())


def set_isa(name: str) -> None:
    """Run the `"generic"` or the `"avx2+fma"` copy from now on (this process); InvalidArgumentError when this
    build or CPU has no such copy or the extension is not built."""
    if _NATIVE is None:
        raise InvalidArgumentError("pagedkv.ops._cpu_decode is not built (or PAGEDKV_NATIVE=0)")
    try:
        _NATIVE.set_isa(name)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None


def available(query: torch.Tensor, kv: torch.Tensor, scales: torch.Tensor | None = None) -> bool:
    """Whether `decode_attention` serves these tensors (see the module docstring)."""
    if scales is None:
        dtypes_ok = query.dtype == kv.dtype and kv.dtype in (torch.float32, torch.bfloat16)
    else:
        dtypes_ok = query.dtype in (torch.float32, torch.bfloat16) and kv.dtype in _CODE_DTYPES
    return (
        _NATIVE is not None
        and dtypes_ok
        and query.device.type == "cpu"
        and kv.device.type == "cpu"
        and not (query.requires_grad or kv.requires_grad)  # the kernel has no backward
    )


def decode_attention(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    options: AttentionOptions,
    *,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[B, H, D]` attention of `query` `[B, H, D]` (sequence i's newest token, at position `seq_lens[i] - 1`)
    over one layer's pages `kv` `[2, num_blocks, block_size, Hkv, D]` through `block_table` `[B, W]`, with
    `options`' scale and sliding window (the kernel has no soft cap and no sinks: asking for them is an
    error). Quantized `kv` (int8/fp8 codes) comes with its `scales` `[2, num_blocks, block_size or 1, Hkv]`;
    bfloat16 `kv` takes a bfloat16 query, quantized `kv` a float32 or bfloat16 one, and the output has the
    query's dtype (a bfloat16 query is widened, exactly, and the float32 answer rounded to bfloat16). Bad shapes, lengths, block ids
    or dtypes raise `InvalidArgumentError`; nothing is written then."""
    if _NATIVE is None:
        raise InvalidArgumentError("pagedkv.ops._cpu_decode is not built (or PAGEDKV_NATIVE=0)")
    if options.soft_cap is not None or options.sinks is not None:
        raise InvalidArgumentError("the C decode kernel has no soft cap and no sinks; use pagedkv.ops.paged_attention")
    if not (query.ndim == 3 and block_table.ndim == 2 and query.shape[0] == block_table.shape[0] == seq_lens.numel()):
        raise InvalidArgumentError(
            f"decode attention: shapes disagree: query {tuple(query.shape)}, block_table {tuple(block_table.shape)}, "
            f"seq_lens {tuple(seq_lens.shape)} (one row per sequence each)"
        )
    quantized = scales is not None or kv.dtype in _CODE_DTYPES
    if quantized and (scales is None or kv.dtype not in _CODE_DTYPES):
        raise InvalidArgumentError("quantized pages (int8/fp8 codes) and scales go together; pass both")
    bf16 = kv.dtype == torch.bfloat16
    wide = query.dtype == torch.bfloat16  # a bfloat16 query runs as float32 (widening is exact), rounded back
    if not quantized and bf16 != wide:
        raise InvalidArgumentError(f"decode attention: a bfloat16 query goes with bfloat16 pages, got {query.dtype}, {kv.dtype}")
    q = query.float().contiguous() if wide else query.contiguous()
    out = torch.empty_like(q)
    if quantized:
        pages = kv.contiguous().view(torch.uint8).numpy()
    else:  # numpy has no bfloat16: the kernel takes its bit patterns as int16
        pages = kv.contiguous().view(torch.int16).numpy() if bf16 else kv.contiguous().numpy()
    sidecar = scales.float().contiguous().numpy() if scales is not None else None
    table, lens = (t.to(torch.int32).contiguous().numpy() for t in (block_table, seq_lens))
    qn, on = q.numpy(), out.numpy()
    scale, window = options.scale_for(query.shape[-1]), int(options.sliding_window or 0)

    def rows(lo: int, hi: int, *team: int) -> None:  # sequences [lo, hi), each computed alone; `team`: OpenMP
        if quantized:
            _NATIVE.decode_codes(qn[lo:hi], pages, sidecar, _lut(kv.dtype).numpy(), table[lo:hi], lens[lo:hi],
                                 on[lo:hi], scale, window, _KINDS[kv.dtype], *team)  # fmt: skip
        else:
            (_NATIVE.decode_bf16 if bf16 else _NATIVE.decode)(qn[lo:hi], pages, table[lo:hi], lens[lo:hi],
                                                              on[lo:hi], scale, window, *team)  # fmt: skip

    try:
        if _OPENMP:  # the split in C, on torch's OpenMP team (module docstring)
            rows(0, q.shape[0], _parts(q.shape[0]))
        else:
            _split_rows(q.shape[0], rows)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(str(e)) from None
    return out.to(query.dtype) if wide else out


def _parts(batch: int) -> int:
    """How many parts a decode group of `batch` sequences is cut into: one per torch thread, at least
    `MIN_ROWS_PER_THREAD` sequences each."""
    return max(1, min(torch.get_num_threads(), batch // MIN_ROWS_PER_THREAD))


def _split_rows(batch: int, rows: Callable[[int, int], None]) -> None:
    """Run `rows(lo, hi)` over `[0, batch)` cut into contiguous parts (`_parts`): the kernel releases the GIL,
    so the parts run at once on a pool of Python threads; the calling thread runs the first. Every row is
    computed alone, so the answer does not depend on the cut."""
    parts = _parts(batch)
    if parts == 1:
        rows(0, batch)
        return
    bounds = [batch * i // parts for i in range(parts + 1)]
    pool = _pool(parts - 1)
    futures = [pool.submit(rows, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    try:
        rows(bounds[0], bounds[1])
    finally:
        for f in futures:
            f.result()


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None or _POOL._max_workers < workers:  # grows with the thread count, never shrinks
        _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedkv-decode")
    return _POOL
