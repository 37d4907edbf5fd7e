"""Shared by the tests of the C extension: loading it (fail, not skip, where a compiler could have built
it), the Python reference it is compared with, and the key contract written out independently."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from native_policy import require_native

from pagedkv.core.hotpath import SHA256, PythonBackend

try:
    from pagedkv.core import _native as native
except ImportError as exc:
    require_native("pagedkv.core._native", False, exc)

REF = PythonBackend()
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

__all__ = ["REF", "SETTINGS", "chain", "content_tokens", "native"]


def chain(kind: int, parent: Any, chunk: bytes) -> Any:
    """The key contract of hotpath's module docstring, written out independently."""
    if kind == SHA256:
        return hashlib.sha256(parent + chunk).digest()
    return hash((parent, chunk, b""))


def content_tokens(content: int, block_size: int) -> np.ndarray:
    """One block's token ids, a function of `content` alone (equal contents: equal blocks)."""
    return (np.arange(block_size, dtype=np.int64) * 7919 + content * 1_000_003).astype(np.int32)


def prefixed(args: dict[str, Any]) -> dict[str, Any]:
    """`publish_rows` keyword arguments from a case that holds the index's structures separately: `index`,
    `key_of` and `keyed` (the same objects, so the case sees what the call mutates) become `prefix`."""
    rest = {k: v for k, v in args.items() if k not in ("index", "key_of", "keyed")}
    return {**rest, "prefix": (args["index"], args["key_of"], args.get("keyed"))}
