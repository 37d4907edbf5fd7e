"""Test-wide settings: one torch thread (shared 2-core machines), Triton's CPU interpreter."""

from __future__ import annotations

import os

# Must be set before any Triton kernel is decorated (i.e. before pagedkv.ops imports triton).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config: object) -> None:
    try:
        import torch
    except ImportError:  # core-only environments
        return
    torch.set_num_threads(1)
