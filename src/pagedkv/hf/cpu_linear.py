"""oneDNN-packed linear layers: the CPU's fast path for a model's projections.

A transformers model's projections are `torch.nn.Linear`, which on a CPU runs a GEMM over the weight as it is
stored, re-laying it out on every call. oneDNN (`torch.ops.mkldnn`) can re-lay a weight once into the blocked
format its kernels read (`_reorder_linear_weight`) and then multiply against it directly
(`_linear_pointwise`); inductor's `freezing` does the same for compiled CPU graphs. For bf16 weights this is
where the CPU's AVX512-BF16 / AMX instructions get used; torch's eager bf16 GEMM does not reach them for
small batches.

Contract:
- `pack_linears(model)` replaces every `torch.nn.Linear` of `model` (in place) by a `PackedLinear` holding the
  packed weight and the same bias; it returns how many it replaced. The original weights are released unless
  another module still holds them (a tied `lm_head` keeps the input embedding's tensor alive: its
  `PackedLinear.tied_to` names that parameter).
- `PackedLinear.repack(weight, bias)` packs new values of the same shape in place of the packed weight (and
  copies the bias): what a weight update calls, since the packed copy does not follow the original tensor.
  `release()` lets the packed copy go (what `sleep(level=2)` calls; `released` says so) until the next
  `repack`; a released layer refuses to run.
- A `PackedLinear` computes `x @ W.T + b` for any number of leading dimensions and any token count. oneDNN
  builds and caches a kernel (a primitive, about 0.6 MiB of JIT code and buffers) for every row count it
  sees, and a server sees hundreds: each call therefore runs over a bounded set of row counts
  (`row_calls`: up to 16 rows as given, then padded with zero rows to a multiple of 8 up to 128 and of 16
  up to 256, larger counts cut into 256-row tiles), at most 38 primitives per weight, so memory stays flat
  under any mix of batch sizes (every row count from 1 to 512, twice, through four SmolLM2 projections
  in bf16: 1.4 GiB of growth without the bound, 0.1 GiB with it). Its results equal
  `torch.nn.functional.linear` up to the GEMM's summation order, not bitwise: greedy tokens in float32 can
  differ from transformers' where two logits tie to the last bit (`linear_backend="torch"` gives
  transformers' float32 arithmetic bit for bit).
- `PackedLinear(..., row_tile=n)` runs every call as GEMMs of exactly `n` rows (the last tile padded with zero
  rows), so a row's result does not depend on how many rows came with it: batch-invariant mode's linear
  (`pagedkv.hf.invariant`).
- `resolve_dtype("auto")` is bfloat16 on such a CPU and the checkpoint's dtype elsewhere (the default of
  `pagedkv serve` and `generate`).
- `choose_linear_backend("auto", dtype)` is "onednn" on a CPU for float32 weights, and for bfloat16 weights
  where the CPU's oneDNN supports bf16 (`onednn_packs`; the faster of the two in both dtypes: `pagedkv bench
  step`, docs/benchmarks.md), "torch" otherwise; "invariant" (batch-invariant mode) is CPU-only;
  `cpu_bf16_support()` says what the CPU offers (for the start-up line).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedkv.core.errors import EngineStateError, InvalidArgumentError

LINEAR_BACKENDS = ("auto", "onednn", "torch", "invariant")
BATCH_HINT = 64  # tokens per step the packed layout is tuned for (a decode batch); any count works
EXACT_ROWS = 16  # row counts up to this run as they are
TILE_ROWS = 256  # larger counts run in tiles of this many rows


def padded_rows(rows: int) -> int:
    """The row count oneDNN runs for a call of `rows` <= `TILE_ROWS` rows (see the module docstring)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 8 if rows <= 128 else 16
    return -(-rows // step) * step


def row_calls(rows: int) -> list[tuple[int, int]]:
    """`(start, count)` of each oneDNN call for `rows` rows: full tiles, then the remainder."""
    calls = [(start, TILE_ROWS) for start in range(0, rows - rows % TILE_ROWS, TILE_ROWS)]
    if rows % TILE_ROWS:
        calls.append((rows - rows % TILE_ROWS, rows % TILE_ROWS))
    return calls


class PackedLinear(torch.nn.Module):
    """`x @ weight.T + bias` with the weight packed once for oneDNN (see the module docstring)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, tied_to: str | None = None,
        row_tile: int | None = None,
    ) -> None:
        super().__init__()
        if row_tile is not None and (isinstance(row_tile, bool) or not isinstance(row_tile, int) or row_tile < 1):
            raise InvalidArgumentError(f"row_tile must be an int >= 1 or None, got {row_tile!r}")
        self.row_tile = row_tile  # every GEMM runs this many rows (see the module docstring)
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT), persistent=False
        )
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.weight_dtype = weight.dtype
        self.tied_to = tied_to  # the model's parameter this weight was packed from, where it outlives the packing
        self.released = False

    def repack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Pack `weight` (`[out_features, in_features]`, cast to the packed dtype) in place of the packed weight,
        and copy `bias` into the bias; a wrong shape (or a bias where the layer has none) changes nothing."""
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (self.out_features, self.in_features):
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise InvalidArgumentError(f"repack: the weight is {got}, the layer's is {(self.out_features, self.in_features)}")
        if bias is not None and (self.bias is None or tuple(bias.shape) != tuple(self.bias.shape)):
            want = None if self.bias is None else tuple(self.bias.shape)
            raise InvalidArgumentError(f"repack: the bias is {tuple(bias.shape)}, the layer's is {want}")
        source = weight.detach().to(device=self.packed_weight.device, dtype=self.weight_dtype)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(source.contiguous(), BATCH_HINT)
        self.released = False
        if bias is not None and self.bias is not None:
            with torch.no_grad():
                self.bias.copy_(bias.detach())

    def release(self) -> int:
        """Let the packed copy go until the next `repack`; returns its bytes (0 when released already)."""
        if self.released:
            return 0
        nbytes = self.packed_weight.numel() * self.packed_weight.element_size()
        self.packed_weight = torch.empty(0, dtype=self.packed_weight.dtype, device=self.packed_weight.device)
        self.released = True
        return nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.released:
            raise EngineStateError("this projection's packed weight was released (sleep level 2); wake_up() first")
        if self.row_tile is not None:
            return tiled_rows(x, self.in_features, self.out_features, self._gemm, self.row_tile)
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows <= EXACT_ROWS:
            return self._gemm(flat).view(*x.shape[:-1], self.out_features)
        parts = [self._rows(flat[start : start + count]) for start, count in row_calls(rows)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(*x.shape[:-1], self.out_features)

    def _rows(self, part: torch.Tensor) -> torch.Tensor:
        """The GEMM of up to `TILE_ROWS` rows, padded with zero rows to `padded_rows`."""
        rows = part.shape[0]
        pad = padded_rows(rows) - rows
        if pad == 0:
            return self._gemm(part)
        return self._gemm(torch.nn.functional.pad(part, (0, 0, 0, pad)))[:rows]

    def _gemm(self, flat: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed_weight, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        tiles = "" if self.row_tile is None else f", {self.row_tile}-row tiles"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN-packed{tiles}"


def tiled_rows(
    x: torch.Tensor,
    in_features: int,
    out_features: int,
    gemm: Callable[[torch.Tensor], torch.Tensor],
    row_tile: int,
) -> torch.Tensor:
    """`gemm` over `x`'s rows, `row_tile` at a time, the last tile padded with zero rows."""
    flat = x.reshape(-1, in_features)
    rows = flat.shape[0]
    if rows == 0:
        return flat.new_empty(*x.shape[:-1], out_features)
    pad = -rows % row_tile
    if pad:
        flat = torch.nn.functional.pad(flat, (0, 0, 0, pad))
    parts = [gemm(flat[start : start + row_tile]) for start in range(0, rows + pad, row_tile)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:rows].view(*x.shape[:-1], out_features)


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN packs and multiplies weights of `dtype` on this CPU (float32; bfloat16
    where oneDNN supports it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def cpu_bf16_support() -> str | None:
    """The CPU's bf16 matrix instructions ("amx_bf16", "avx512_bf16"), or None where it has neither or
    oneDNN cannot use them."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    for name in ("amx_bf16", "avx512_bf16"):
        if name in flags:
            return name
    return None


def choose_linear_backend(backend: str, dtype: torch.dtype, device: torch.device) -> str:
    """ "onednn", "torch" or "invariant" for a model of `dtype` on `device` (see the module docstring)."""
    if backend not in LINEAR_BACKENDS:
        raise InvalidArgumentError(
            f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {backend!r}"
        )
    if backend == "invariant":
        if device.type != "cpu":
            raise InvalidArgumentError(f"batch-invariant mode runs on a CPU; this model is on {device}")
        return "invariant"
    if device.type != "cpu":
        if backend == "onednn":
            raise InvalidArgumentError(f"linear_backend 'onednn' is for CPU models; this one is on {device}")
        return "torch"
    if backend == "onednn":
        if not torch.backends.mkldnn.is_available():
            raise InvalidArgumentError("linear_backend 'onednn': this torch build has no oneDNN (mkldnn)")
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            raise InvalidArgumentError(
                "linear_backend 'onednn': this CPU has no bf16 support in oneDNN; use 'torch'"
            )
        return "onednn"
    packable = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_bf16_support() is not None)
    if backend == "auto" and torch.backends.mkldnn.is_available() and packable:
        return "onednn"
    return "torch"


def resolve_dtype(dtype: str | None) -> str | None:
    """The model dtype a command loads: "auto" is "bfloat16" on a CPU with bf16 matrix instructions
    (`cpu_bf16_support`), the checkpoint's own (None) elsewhere; any other name is itself."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if cpu_bf16_support() is not None else None


def describe_weights(requested: str | None, dtype: torch.dtype, linear_backend: str) -> str:
    """One phrase for a start-up line: the weights' dtype, why ("auto"), and the linear backend."""
    name = str(dtype).removeprefix("torch.")
    why = ""
    if requested == "auto":
        support = cpu_bf16_support()
        why = (
            f" (auto: the CPU has {support})"
            if support
            else " (auto: no bf16 matrix instructions on this CPU)"
        )
    kind = {"onednn": "oneDNN-packed", "invariant": "batch-invariant"}.get(linear_backend, "torch")
    return f"{name} weights{why}, {kind} linear"


def pack_linears(model: Any) -> int:
    """Replace every `torch.nn.Linear` of `model` by a `PackedLinear`, in place; return the count. A weight
    that another (non-linear) parameter shares, such as a tied `lm_head`, names it in `tied_to`."""
    linear_weights = {f"{prefix}.weight" for prefix, m in model.named_modules() if type(m) is torch.nn.Linear}
    names: dict[int, list[str]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(pname)
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                tied = [n for n in names.get(id(child.weight), []) if n not in linear_weights]
                packed = PackedLinear(child.weight, child.bias, tied_to=tied[0] if tied else None)
                setattr(module, name, packed)
                count += 1
    return count


def packed_linears(model: Any) -> dict[str, PackedLinear]:
    """Every `PackedLinear` of `model` under the name of the weight it was packed from (`<module>.weight`)."""
    return {f"{prefix}.weight": m for prefix, m in model.named_modules() if isinstance(m, PackedLinear)}
