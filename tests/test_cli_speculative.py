"""`--speculative SPEC` on `pagedkv generate`, `pagedkv serve` (one server and the replicas' engine) and
`pagedkv bench e2e`: a setting that cannot be read is one line and exit 2 before anything loads; a good one
reaches the engine, and greedy output is the same with it as without. The server is built by `pagedkv
serve`'s own code from its parsed flags and answered through the `openai` client."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedkv.cli import main
from pagedkv.engine.cli_args import OneLineParser
from pagedkv.engine.speculative import SpeculativeConfig

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(62)]
PROMPT = "w3 w4 w5 w6 w3 w4 w5 w6 w3 w4"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 1-layer Llama with a whitespace word-level tokenizer, saved as a transformers folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-spec")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("command", [["generate", "w1"], ["serve"], ["bench", "e2e"]], ids=" ".join)
@pytest.mark.parametrize("spec", ["beam:k=2", "ngram:k=0", "ngram:q=1", "draft:k=3"])
def test_an_unreadable_setting_is_one_line_exit_2(command: list[str], spec: str, capsys: Any) -> None:
    assert main([*command, "--speculative", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"pagedkv {command[0]}") and "argument --speculative: " in err, err


def _parse(add_arguments: Any, argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="pagedkv test")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_setting_reaches_every_engine_config() -> None:
    from pagedkv.bench import e2e
    from pagedkv.engine import generate_command
    from pagedkv.engine.from_args import config_from_args
    from pagedkv.serve import serve_command

    want = SpeculativeConfig("ngram", 3, prompt_lookup_min=1)
    assert config_from_args(_parse(generate_command.add_arguments, ["x"])).speculative is None  # default off
    for add in (generate_command.add_arguments, serve_command.add_arguments):
        args = _parse(add, ["--speculative", "ngram:k=3,min=1", "--num-blocks", "8"])
        assert config_from_args(args).speculative == want
    args = _parse(e2e.add_arguments, ["--speculative", "ngram:k=3,min=1"])
    assert e2e.pagedkv_config("pagedkv-paged", args)["speculative"] == want.describe()
    assert e2e.pagedkv_config("pagedkv-contiguous", args)["speculative"] == "off"


def test_generate_speculates_and_prints_the_same_text(tiny_folder: Path, capsys: Any) -> None:
    argv = ["generate", "--no-progress", PROMPT, "--model", str(tiny_folder), "--max-new-tokens", "24",
            "--ignore-eos", "--num-blocks", "64"]  # fmt: skip
    assert main(argv) == 0
    plain = capsys.readouterr()
    assert main([*argv, "--speculative", "ngram:k=4,min=1"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out and spec.out.count("w") == 24
    assert "speculation ngram:k=4,min=1,max=4:" in spec.err and "draft tokens accepted" in spec.err, spec.err
    assert "speculation" not in plain.err


def test_generate_with_a_draft_model_prints_the_same_text(tiny_folder: Path, capsys: Any) -> None:
    """`draft:PATH`: the target's own folder as its draft, so every draft token is accepted."""
    argv = ["generate", "--no-progress", PROMPT, "--model", str(tiny_folder), "--max-new-tokens", "16",
            "--ignore-eos", "--num-blocks", "64"]  # fmt: skip
    assert main(argv) == 0
    plain = capsys.readouterr()
    assert main([*argv, "--speculative", f"draft:{tiny_folder},k=3"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out
    assert f"speculation draft:{tiny_folder},k=3:" in spec.err and "accepted (1.00)" in spec.err, spec.err


def test_the_replicas_engine_speculates(tiny_folder: Path) -> None:
    """`--replicas N` builds each replica's engine from the config of the same flags (`ray_cli.replica_engine`)."""
    from pagedkv.engine.from_args import config_from_args
    from pagedkv.serve import serve_command
    from pagedkv.serve.ray_cli import replica_engine

    args = _parse(serve_command.add_arguments, ["--model", str(tiny_folder), "--num-blocks", "32", "--replicas", "2",
                                                "--threads", "1", "--speculative", "ngram:k=2"])  # fmt: skip
    engine = replica_engine(config_from_args(args), None, model=args.model, dtype=args.dtype, threads=1, replicas=2)
    assert engine.config.speculative == SpeculativeConfig("ngram", 2) and engine.config.kv_events


@pytest.fixture(scope="module")
def served(tiny_folder: Path) -> Iterator[tuple[str, Any]]:
    """`pagedkv serve --speculative ngram:k=4,min=1,budget=0 --no-engine-process` on the tiny folder, in a
    thread: (url, its engine, which the tests read). No step budget: the metrics' test needs drafts in every step, whatever the steps cost."""
    from pagedkv.serve import serve_command

    args = _parse(serve_command.add_arguments, ["--model", str(tiny_folder), "--port", "0", "--num-blocks", "64",
                                                "--served-model-name", "tiny", "--threads", "1", "--no-engine-process",
                                                "--speculative", "ngram:k=4,min=1,budget=0"])  # fmt: skip
    server, sock, _ = serve_command._build_server(args)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    engine = server.config.app.state.context.engine.engine
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(30)


def test_serve_speculates_and_answers_as_without(served: tuple[str, Any], tiny_folder: Path) -> None:
    import openai

    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams

    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert got.usage is not None and got.usage.completion_tokens == 24
    assert engine.stats.spec is not None and engine.stats.spec.num_drafts > 0
    plain = Engine(engine.model, engine.tokenizer, engine.config.__class__(num_blocks=64))
    want = plain.generate([PROMPT], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert got.choices[0].text == want.output_text


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_metrics_count_drafts_and_acceptance_as_vllm_names_them(served: tuple[str, Any]) -> None:
    import openai

    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    before = _scrape(url)
    for prompt in (PROMPT, "w9 w8 w9 w8 w9 w8 w7"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    after = _scrape(url)
    spec = engine.stats.spec
    assert spec is not None and spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    # cumulative since start: the module's earlier test's requests included
    assert after[("pagedkv:spec_decode_num_drafts_total", ())] == spec.num_drafts
    assert after[("pagedkv:spec_decode_num_draft_tokens_total", ())] == spec.num_draft_tokens
    assert after[("pagedkv:spec_decode_num_accepted_tokens_total", ())] == spec.num_accepted_tokens
    per_pos = [after[("pagedkv:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
               for i in range(4)]  # fmt: skip
    assert per_pos == spec.accepted_per_pos and per_pos[0] >= per_pos[1] >= per_pos[2] >= per_pos[3]
    assert sum(per_pos) == spec.num_accepted_tokens
    moved = after[("pagedkv:spec_decode_num_drafts_total", ())] - before.get(("pagedkv:spec_decode_num_drafts_total", ()), 0)
    assert moved > 0


def test_a_server_that_does_not_speculate_has_no_speculation_samples() -> None:
    from pagedkv.serve.metrics import ServerMetrics

    text = ServerMetrics("m").exposition().decode()
    assert "# TYPE pagedkv:spec_decode_num_drafts_total counter" in text  # declared, with no sample
    assert not [line for line in text.splitlines() if line.startswith("pagedkv:spec_decode")]
