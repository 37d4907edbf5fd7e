"""Serve Hugging Face transformers models on pagedkv storage.

The integration has three pieces, each in its own module:

- `model_spec`: what the KV cache of a model looks like (layers, KV heads, head dim, dtype, sliding windows),
  read from its config, and a check that the model can be served at all (a clear error naming what is
  missing otherwise, never wrong output).
- `step_metadata`: the per-step batch description (packed token ids, positions, slot mapping, block tables,
  sequence lengths) built from the allocator's numpy views.
- `attention` + `cache`: an attention function registered with transformers under the name `"pagedkv"` and
  the `PagedKVCache` it writes into and reads from. Per-step metadata reaches it through the forward's
  keyword arguments (`pagedkv_step=...`); there is no global forward context.

Nothing is imported eagerly: `import pagedkv.hf` does not load torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelSpec": "pagedkv.hf.model_spec",
    "model_spec": "pagedkv.hf.model_spec",
    "check_supported": "pagedkv.hf.model_spec",
    "UnsupportedModelError": "pagedkv.hf.model_spec",
    "PagedKVCache": "pagedkv.hf.cache",
    "PagedStep": "pagedkv.hf.cache",
    "StepBatch": "pagedkv.hf.step_metadata",
    "build_step_batch": "pagedkv.hf.step_metadata",
    "ATTENTION_NAME": "pagedkv.hf.attention",
    "register_attention": "pagedkv.hf.attention",
    "prepare_model": "pagedkv.hf.attention",
    "load_model": "pagedkv.hf.loading",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
