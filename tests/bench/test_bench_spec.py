"""`pagedkv bench spec` end to end on a tiny model: every (workload, batch) cell of `--batches 1,4,saturated`
runs `--repeat` interleaved pairs, both systems produce the same tokens, the grounded workload speculates
(a tokenizer without a chat template gets the plain instruction), and a bad `--batches` is one line and
exit 2 before anything loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.cli import main

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(254)]  # more than the 100 ids bench e2e's prompts skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 1-layer Llama of 256 words, 1024 positions, and a word-level tokenizer with no chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-bench-spec")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=1, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_batches_1_4_saturated_with_three_repeats(tiny: Path, capsys: Any) -> None:
    argv = ["bench", "spec", "--model", str(tiny), "--batches", "1,4,saturated", "--repeat", "3", "--num-grounded",
            "2", "--num-requests", "3", "--prompt-scale", "64", "--output-scale", "64", "--threads", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["repeat"] == 3 and result["speculative"].startswith("ngram:k=4")
    want = [f"{w}/{b}" for w in ("grounded", "conversation") for b in ("1", "4", "saturated")]
    assert list(result["cells"]) == want
    for key, cell in result["cells"].items():
        assert cell["identical"], key
        assert len(cell["ratios"]) == 3 and cell["ratio_min"] <= cell["ratio"] <= cell["ratio_max"], key
        assert len(cell["plain"]["runs_tokens_per_s"]) == len(cell["spec"]["runs_tokens_per_s"]) == 3, key
        assert cell["plain"]["output_tokens"] == cell["spec"]["output_tokens"] > 0, key
        assert "acceptance_rate" not in cell["plain"] and "acceptance_rate" in cell["spec"], key
    assert all(result["cells"][f"grounded/{b}"]["spec"]["num_drafts"] > 0 for b in ("1", "4", "saturated"))


def test_a_bad_batch_list_is_one_line(tiny: Path, capsys: Any) -> None:
    assert main(["bench", "spec", "--model", str(tiny), "--batches", "1,0"]) == 2
    err = capsys.readouterr().err
    assert "--batches" in err and len(err.strip().splitlines()) == 1
