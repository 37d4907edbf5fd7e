"""The first GGUF conversion is not silent (issue 20 item 11): one line on stderr even when piped, and the
tensor-by-tensor bar only on a terminal. The conversion itself is stubbed (it takes a minute)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")


def test_first_conversion_says_so_and_a_cached_one_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    import pagedkv.hf.loading as loading
    from pagedkv.hf.tiny import tiny_model

    model = tiny_model("llama")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(loading, "cached_digest", lambda source, m: None)
    source = loading.ModelSource(tmp_path, "m.gguf", tmp_path / "cache" / "abc")
    loading.load_weights(source)
    err = capsys.readouterr().err
    assert "de-quantising m.gguf once" in err and str(source.cache_folder) in err and "\r" not in err
    bar: Any = gguf_utils.tqdm  # type: ignore[attr-defined]
    assert getattr(bar, "keywords", {}).get("disable") is True, "no tensor bar when stderr is not a terminal"
    (source.cache_folder / loading._COMPLETE).parent.mkdir(parents=True)  # type: ignore[union-attr]
    (source.cache_folder / loading._COMPLETE).write_text("done\n")  # type: ignore[operator]
    loading.load_weights(source)
    assert "de-quantising" not in capsys.readouterr().err
