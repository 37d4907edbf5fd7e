"""The element-wise parts of a Llama layer in C, for `FusedLlama` on a CPU.

Between its GEMMs a Llama layer runs about 25 small torch operations (two RMSNorms, the rotary embedding on q
and k, the residual adds, SiLU times up). Each is a dispatch from Python on one thread, and at a decode batch
they cost as much as the attention (`pagedkv bench step`, "other"). `LayerOps` runs them as three C calls a
layer instead, each split over the torch threads:

```
norm(x, delta, weight, out)          x += delta (if given); out = RMSNorm(x) * weight
rope(qkv, cos, sin, q, k, v)         q, k rotated out of the fused q|k|v rows; v copied
silu_mul(gate_up, out)               out = silu(gate) * up
```

Contract:
- `LayerOps.for_rows(rows, dtype, ...)` returns the calls and the step's buffers for `rows` tokens of a
  float32 or bfloat16 model on a CPU, or None where the C extension is absent (or `PAGEDKV_NATIVE=0`) or the
  dtype is another one (the caller then runs torch's operations).
- Every call checks its tensors (dtype, shape, C-contiguity, CPU) and raises `InvalidArgumentError` before
  anything is written; the C functions (`pagedkv.hf._cpu_layer`) trust them.
- Results: rope and the residual add equal torch's operations bit for bit (each bfloat16 product and sum
  rounded where torch rounds it); RMSNorm differs from torch's in the order of the mean's sum, SiLU in the
  last bit of its exponential; so the C path is for the packed (oneDNN) backend, whose GEMMs already differ
  from transformers' in summation order, and `linear_backend="torch"` keeps torch's operations.
- A row's result does not depend on the other rows nor on the thread count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.hotpath import load_extension

# None where it was built without a C compiler (or PAGEDKV_NATIVE=0): FusedLlama runs torch's operations
_c = load_extension("pagedkv.hf._cpu_layer")

DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether the C extension is built."""
    return _c is not None


@dataclass(slots=True)
class LayerOps:
    """The C calls over `rows` tokens and the step's buffers (see the module docstring)."""

    rows: int
    dtype: torch.dtype
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    threads: int
    h: torch.Tensor  # [rows, hidden]: a norm's output, the next GEMM's input
    q: torch.Tensor  # [rows, heads, head_dim]
    k: torch.Tensor  # [rows, kv_heads, head_dim]
    v: torch.Tensor  # [rows, kv_heads, head_dim]
    act: torch.Tensor  # [rows, intermediate]

    @classmethod
    def for_rows(
        cls, rows: int, dtype: torch.dtype, *, hidden: int, heads: int, kv_heads: int, head_dim: int,
        intermediate: int, eps: float, threads: int | None = None,
    ) -> LayerOps | None:  # fmt: skip
        if _c is None or dtype not in DTYPES:
            return None
        if min(rows, hidden, heads, kv_heads, head_dim, intermediate) < 1 or head_dim % 2:
            raise InvalidArgumentError(
                f"LayerOps: sizes must be positive and head_dim even, got rows={rows} hidden={hidden} "
                f"heads={heads} kv_heads={kv_heads} head_dim={head_dim} intermediate={intermediate}"
            )

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype)

        return cls(
            rows, dtype, hidden, heads, kv_heads, head_dim, intermediate, float(eps),
            max(1, threads if threads is not None else torch.get_num_threads()),
            empty(rows, hidden), empty(rows, heads, head_dim), empty(rows, kv_heads, head_dim),
            empty(rows, kv_heads, head_dim), empty(rows, intermediate),
        )  # fmt: skip

    @property
    def _bf16(self) -> bool:
        return self.dtype is torch.bfloat16

    def norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """`x += delta` (in place, where given), then `self.h = RMSNorm(x) * weight`; returns `self.h`."""
        self._check("x", x, (self.rows, self.hidden))
        if delta is not None:
            self._check("delta", delta, (self.rows, self.hidden))
        self._check("weight", weight, (self.hidden,))
        _c.rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),  # type: ignore[union-attr]
                    self.h.data_ptr(), self.rows, self.hidden, self.eps, self._bf16, self.threads)  # fmt: skip
        return self.h

    def rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`self.q`, `self.k` (rotated) and `self.v` from the rows of the fused q|k|v projection."""
        self._check("qkv", qkv, (self.rows, (self.heads + 2 * self.kv_heads) * self.head_dim))
        self._check("cos", cos, (self.rows, self.head_dim))
        self._check("sin", sin, (self.rows, self.head_dim))
        _c.rope_split(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), self.q.data_ptr(), self.k.data_ptr(),  # type: ignore[union-attr]
                      self.v.data_ptr(), self.rows, self.heads, self.kv_heads, self.head_dim, self._bf16,
                      self.threads)  # fmt: skip
        return self.q, self.k, self.v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`self.act = silu(gate) * up` from the rows of the fused gate|up projection; returns `self.act`."""
        self._check("gate_up", gate_up, (self.rows, 2 * self.intermediate))
        _c.silu_mul(gate_up.data_ptr(), self.act.data_ptr(), self.rows, self.intermediate, self._bf16, self.threads)  # type: ignore[union-attr]
        return self.act

    def _check(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"LayerOps: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype != self.dtype or tuple(t.shape) != shape or t.device.type != "cpu" or not t.is_contiguous():
            raise InvalidArgumentError(
                f"LayerOps: {name} must be a C-contiguous CPU {self.dtype} tensor of shape {shape}, got "
                f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}"
            )
