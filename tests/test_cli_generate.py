"""`pagedkv generate` on a terminal: the text streams as tokens are produced; piped, it comes at the end; the
KV budget typed is said back resolved."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from pagedkv.cli import main

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(62)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 1-layer Llama with 64 positions and a whitespace word-level tokenizer, saved as a folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


class _Recorder(io.StringIO):
    """stdout that records each write beside the engine's steps, in order; a terminal when `tty`."""

    def __init__(self, events: list[str], tty: bool) -> None:
        super().__init__()
        self.events, self.tty = events, tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        if text:
            self.events.append(f"out:{text}")
        return super().write(text)


def _run(tiny_model: Path, tty: bool, monkeypatch: pytest.MonkeyPatch, capsys: Any, *extra: str) -> tuple[list[str], str]:
    from pagedkv.engine.llm_engine import Engine

    events: list[str] = []
    step = Engine.step

    def counted(self: Engine) -> Any:
        events.append("step")
        return step(self)

    monkeypatch.setattr(Engine, "step", counted)
    out = _Recorder(events, tty)
    monkeypatch.setattr("sys.stdout", out)
    argv = ["generate", "--no-progress", "w3 w4 w5", "--model", str(tiny_model), "--max-new-tokens", "8",
            "--ignore-eos", *extra]  # fmt: skip
    assert main(argv) == 0
    return events, out.getvalue()


def test_the_text_streams_to_a_terminal_as_tokens_are_produced(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    events, text = _run(tiny_model, True, monkeypatch, capsys)
    piped_events, piped_text = _run(tiny_model, False, monkeypatch, capsys)
    assert text == piped_text and text.count("w") == 8  # the same completion, one line
    writes = [i for i, e in enumerate(events) if e.startswith("out:")]
    steps = [i for i, e in enumerate(events) if e == "step"]
    assert len(writes) >= 4 and writes[0] < steps[-1], events  # written while the steps run
    piped_writes = [i for i, e in enumerate(piped_events) if e.startswith("out:")]
    assert min(piped_writes) > max(i for i, e in enumerate(piped_events) if e == "step")  # at the end


def test_several_completions_are_printed_whole_even_on_a_terminal(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    _, text = _run(tiny_model, True, monkeypatch, capsys, "--n", "2", "--seed", "1", "--temperature", "1")
    assert [line[:7] for line in text.splitlines()] == ["[req-0]", "[req-0."]


def test_the_kv_budget_is_said_back_resolved(tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    _run(tiny_model, False, monkeypatch, capsys, "--kv-budget", "1gb")
    err = capsys.readouterr().err
    assert "pagedkv generate: kv budget: 0.93 GiB (1,000,000,000 bytes)" in err, err
