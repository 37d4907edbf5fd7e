from __future__ import annotations

import json

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.sim.catalog import BUILTIN_GPUS, BUILTIN_MODELS, Catalog, GPUSpec, ModelShape

MIB = 1024**2


def params_from_shape(m: ModelShape) -> int:
    """Parameter count implied by the shape (Llama-style: gated MLP, RMSNorm, no biases)."""
    q_out = m.num_attention_heads * m.head_dim
    kv_out = m.num_kv_heads * m.head_dim
    attn = m.hidden_size * (q_out + 2 * kv_out) + q_out * m.hidden_size
    mlp = 3 * m.hidden_size * m.intermediate_size
    norms = 2 * m.hidden_size
    embed = m.vocab_size * m.hidden_size
    head = 0 if m.tie_word_embeddings else embed
    return embed + head + m.hidden_size + m.num_layers * (attn + mlp + norms)


def test_builtin_names_are_the_issue_list() -> None:
    assert set(BUILTIN_GPUS) == {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4"}, "GPU list drifted"
    assert set(BUILTIN_MODELS) == {
        "llama-2-7b",
        "llama-2-13b",
        "llama-2-70b",
        "llama-3-8b",
        "llama-3-70b",
        "mistral-7b",
        "qwen2.5-7b",
        "smollm2-135m",
        "mistral-7b-v0.1",
        "gemma-2-9b",
        "gemma-2-27b",
        "gemma-3-12b",
        "gemma-3-27b",
        "gpt-oss-20b",
        "gpt-oss-120b",
        "ministral-8b",
    }, "model list drifted"


# Not Llama-shaped: mixtures of experts (gpt-oss) and checkpoints with a vision tower (Gemma 3).
_NOT_LLAMA_SHAPED = {"gpt-oss-20b", "gpt-oss-120b", "gemma-3-12b", "gemma-3-27b"}


@pytest.mark.parametrize(
    "model", [m for m in BUILTIN_MODELS.values() if m.name not in _NOT_LLAMA_SHAPED], ids=lambda m: m.name
)
def test_published_param_counts_match_the_shapes(model: ModelShape) -> None:
    # Qwen2.5 has q/k/v biases (28 layers x (3584 + 2 x 512)), which the Llama-style count leaves out;
    # Gemma 2 normalises after attention and after the MLP too (two more norms per layer).
    biases = 28 * (3584 + 2 * 512) if model.name == "qwen2.5-7b" else 0
    biases += 2 * model.hidden_size * model.num_layers if model.name.startswith("gemma-2") else 0
    assert params_from_shape(model) + biases == model.num_params, f"{model.name}: shape and count disagree"


def test_kv_bytes_per_token_by_hand() -> None:
    # 2 (K and V) x layers x kv heads x head dim x 2 bytes
    assert BUILTIN_MODELS["llama-2-7b"].kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288, "7B"
    assert BUILTIN_MODELS["llama-2-13b"].kv_bytes_per_token == 2 * 40 * 40 * 128 * 2 == 819_200, "13B"
    assert BUILTIN_MODELS["llama-3-70b"].kv_bytes_per_token == 2 * 80 * 8 * 128 * 2, "GQA 70B"
    assert BUILTIN_MODELS["smollm2-135m"].kv_bytes_per_token == 2 * 30 * 3 * 64 * 2, "SmolLM2"


def test_datasheet_figures() -> None:
    a100 = BUILTIN_GPUS["a100-40gb"]
    assert (a100.memory_bytes, a100.hbm_bandwidth_bytes_per_s, a100.bf16_flops_per_s) == (
        40960 * MIB,
        1555e9,
        312e12,
    ), "A100-40GB datasheet"
    assert BUILTIN_GPUS["h100-80gb"].bf16_flops_per_s == 989e12, "H100 dense bf16, not the sparse figure"
    assert BUILTIN_GPUS["h200"].hbm_bandwidth_bytes_per_s == 4.8e12, "H200 bandwidth"


def test_lookup_is_case_and_alias_tolerant() -> None:
    cat = Catalog.builtin()
    assert cat.gpu("A100-40GB").name == "a100-40gb", "case"
    assert cat.gpu("h100-80gb-sxm").name == "h100-80gb", "alias from the issue"
    assert cat.model("Llama-2-7B").name == "llama-2-7b", "case"


def test_unknown_names_are_clear_errors() -> None:
    cat = Catalog.builtin()
    with pytest.raises(InvalidArgumentError, match=r"unknown GPU 'tpu-v9'.*a100-40gb"):
        cat.gpu("tpu-v9")
    with pytest.raises(InvalidArgumentError, match=r"unknown model 'gpt-5'.*llama-2-7b"):
        cat.model("gpt-5")


def test_user_file_json_and_yaml(tmp_path) -> None:
    j = tmp_path / "cat.json"
    j.write_text(
        json.dumps(
            {
                "gpus": {"my-gpu": {"memory_gb": 48, "hbm_bandwidth_gb_per_s": 864, "bf16_tflops": 362}},
                "models": {
                    "tiny": {
                        "num_params": 1000,
                        "num_layers": 2,
                        "hidden_size": 64,
                        "num_attention_heads": 4,
                        "num_kv_heads": 2,
                        "head_dim": 16,
                        "intermediate_size": 128,
                        "vocab_size": 100,
                        "max_model_len": 512,
                    }
                },
            }
        )
    )
    cat = Catalog.builtin()
    cat.load_file(j)
    assert cat.gpu("my-gpu").memory_bytes == 48 * 1024**3, "memory_gb is GiB"
    assert cat.gpu("my-gpu").bf16_flops_per_s == 362e12, "TFLOP/s converted"
    assert cat.model("tiny").kv_bytes_per_token == 2 * 2 * 2 * 16 * 2, "user model"
    y = tmp_path / "cat.yaml"
    y.write_text(
        "gpus:\n  a100-40gb:\n    memory_gb: 20\n    hbm_bandwidth_gb_per_s: 1\n    bf16_tflops: 1\n"
    )
    cat.load_file(y)
    assert cat.gpu("a100-40gb").memory_bytes == 20 * 1024**3, "user entries override built-ins"


def test_user_file_errors_name_the_problem(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpus": {"x": {"memory_gb": 1, "bandwidth": 2}}}')
    with pytest.raises(InvalidArgumentError, match=r"bad.json.*'x'.*unknown field.*bandwidth"):
        Catalog.builtin().load_file(bad)
    broken = tmp_path / "broken.json"
    broken.write_text('{"gpus": \n {')
    with pytest.raises(InvalidArgumentError, match=r"broken.json: not valid JSON at line 2"):
        Catalog.builtin().load_file(broken)
    neg = tmp_path / "neg.yaml"
    neg.write_text("gpus:\n  g:\n    memory_gb: -1\n    hbm_bandwidth_gb_per_s: 1\n    bf16_tflops: 1\n")
    with pytest.raises(InvalidArgumentError, match=r"'g'.*memory_bytes must be a positive number"):
        Catalog.builtin().load_file(neg)


def test_spec_validation() -> None:
    with pytest.raises(InvalidArgumentError, match="lowercase"):
        GPUSpec("A100", 1, 1.0, 1.0)
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        ModelShape("m", 1, 1, 8, 3, 2, 4, 8, 8, 8)
