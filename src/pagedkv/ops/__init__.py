"""Paged attention and KV writes: a torch reference path (any device) and Triton kernels (CUDA).

Public API: `paged_attention`, `write_kv` (pagedkv.ops.attention), the backend switch `use_backend` /
`choose_backend` (pagedkv.ops.dispatch), and the metadata adapters in `pagedkv.ops.metadata`. Triton is
imported only when its backend runs, so this package works where triton is missing.
"""

from __future__ import annotations

from pagedkv.ops.attention import paged_attention, write_kv
from pagedkv.ops.dispatch import choose_backend, use_backend

__all__ = ["choose_backend", "paged_attention", "use_backend", "write_kv"]
