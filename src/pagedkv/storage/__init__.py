"""KV storage: per-layer K/V tensors indexed by block id, sized from a byte budget.

`KVCacheSpec` (the model's KV shape and the budget arithmetic) is torch-free, so the simulator and planner
can size pools without loading torch; `KVStorage` and `HostBlocks` load torch when first touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.storage.kv_spec import KVCacheSpec

if TYPE_CHECKING:
    from pagedkv.storage.kv import HostBlocks, KVStorage

__all__ = ["HostBlocks", "KVCacheSpec", "KVStorage"]


def __getattr__(name: str) -> Any:
    if name in ("KVStorage", "HostBlocks"):
        from pagedkv.storage import kv

        return getattr(kv, name)
    raise AttributeError(f"module 'pagedkv.storage' has no attribute {name!r}")
