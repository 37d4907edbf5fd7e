"""update_weights on every linear backend: whatever the engine packed or fused from the weights follows them.

The oneDNN backend multiplies against packed copies of the projections (`pagedkv.hf.cpu_linear`) and the
fused forward against concatenated q/k/v and gate/up weights and biases (`pagedkv.hf.fused_llama`); after an
update to another seed's weights every greedy output must equal a fresh engine's built on the new weights,
token for token, with the prefix cache and the host tier warm. The tiny models cover the fused Llama (with
and without biases), transformers' own forward over packed projections, and a tied `lm_head` (gpt2)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.cpu_linear import PackedLinear, packed_linears
from pagedkv.hf.tiny import VOCAB, tiny_model

from .test_lifecycle import rollout_prompts

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
FUSED_BIASES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # concatenated by the fused forward
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [])


def model_of(family: str, seed: int, dtype: torch.dtype) -> Any:
    if family == "llama-bias":  # q/k/v/o and MLP biases: the fused forward concatenates them into copies
        import transformers as tf

        torch.manual_seed(seed)
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0, attention_bias=True, mlp_bias=True)  # fmt: skip
        model = tf.LlamaForCausalLM(cfg).eval()
        with torch.no_grad():  # transformers starts biases at zero: the fused ones are drawn to change the outputs
            for name, p in model.named_parameters():
                if name.endswith("bias") and any(f"{n}.bias" in name for n in FUSED_BIASES):
                    p.normal_(0.0, 0.5)
    else:
        model = tiny_model(family, seed=seed)
    return model.to(dtype)


def config(backend: str, forward: str) -> EngineConfig:
    return EngineConfig(num_blocks=24, block_size=4, host_blocks=64, linear_backend=backend, model_forward=forward)


def greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    engine.generate(prompts, GREEDY)  # the prefix cache and the host tier fill up; the checked round hits them
    return [o.output_token_ids for o in engine.generate(prompts, GREEDY)]


CASES = [
    ("llama", "fused"),  # the fused forward: packed (onednn) or views of concatenated weights (torch)
    ("llama-bias", "fused"),  # ... with concatenated biases
    ("llama", "transformers"),  # transformers' forward over pack_linears' projections
    ("qwen2", "auto"),  # not fusable: q/k/v biases on packed projections
    ("gpt2", "auto"),  # a tied lm_head, packed from the input embedding
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", ["torch", "onednn"])
@pytest.mark.parametrize(("family", "forward"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_after_update_every_output_is_a_fresh_engine_s(family: str, forward: str, backend: str, dtype: torch.dtype) -> None:
    prompts = rollout_prompts(6)
    engine = Engine(model_of(family, 0, dtype), None, config(backend, forward))
    assert engine.linear_backend == backend
    assert (engine.runner.fused is not None) == (forward == "fused")
    old = greedy(engine, prompts)
    new = {k: v.clone() for k, v in model_of(family, 1, dtype).state_dict().items()}
    assert engine.update_weights(new).weight_version == "1"
    got = greedy(engine, prompts)
    want = greedy(Engine(model_of(family, 1, dtype), None, config(backend, forward)), prompts)
    assert want != old  # the new weights change the rollouts: a stale packed or fused copy would show
    assert got == want
    engine.manager.check_invariants()


@pytest.mark.parametrize("backend", ["torch", "onednn"])
def test_an_update_of_the_biases_alone_reaches_the_fused_forward_s_concatenated_copies(backend: str) -> None:
    prompts = rollout_prompts(6)
    engine = Engine(model_of("llama-bias", 0, torch.float32), None, config(backend, "fused"))
    old = greedy(engine, prompts)
    biases = {k: v for k, v in model_of("llama-bias", 1, torch.float32).state_dict().items() if k.endswith("bias")}
    engine.update_weights(biases)
    target = model_of("llama-bias", 0, torch.float32)
    target.load_state_dict(biases, strict=False)
    want = greedy(Engine(target, None, config(backend, "fused")), prompts)
    assert want != old
    assert greedy(engine, prompts) == want


def test_a_tied_lm_head_follows_its_embedding_whichever_name_is_given() -> None:
    prompts = rollout_prompts(4)
    engine = Engine(model_of("gpt2", 0, torch.float32), None, config("onednn", "auto"))
    packed = packed_linears(engine.model)
    assert packed["lm_head.weight"].tied_to == "transformer.wte.weight"
    fresh = greedy(Engine(model_of("gpt2", 1, torch.float32), None, config("onednn", "auto")), prompts)
    new = model_of("gpt2", 1, torch.float32).state_dict()
    # only the lm_head's name for the shared tensor, then only the embedding's
    engine.update_weights({k: v for k, v in new.items() if k != "transformer.wte.weight"})
    assert greedy(engine, prompts) == fresh
    engine.update_weights(model_of("gpt2", 0, torch.float32).state_dict())
    engine.update_weights({k: v for k, v in new.items() if k != "lm_head.weight"})
    assert greedy(engine, prompts) == fresh


def test_repack_checks_its_input_and_changes_nothing_on_a_bad_one() -> None:
    weight, bias = torch.randn(6, 4), torch.randn(6)
    layer = PackedLinear(weight, bias)
    x = torch.randn(3, 4)
    before = layer(x)
    with pytest.raises(InvalidArgumentError, match="weight is \\(4, 6\\)"):
        layer.repack(weight.T)
    with pytest.raises(InvalidArgumentError, match="bias is \\(5,\\)"):
        layer.repack(weight, torch.zeros(5))
    assert torch.equal(layer(x), before)
    layer.repack(2 * weight, torch.zeros(6))
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, 2 * weight))


def test_a_packed_projection_s_wrong_shape_is_refused_by_name_and_changes_nothing() -> None:
    prompts = rollout_prompts(4)
    engine = Engine(model_of("llama", 0, torch.float32), None, config("onednn", "transformers"))
    before = greedy(engine, prompts)
    with pytest.raises(InvalidArgumentError, match="q_proj.weight.*is \\(64, 63\\), the model's is \\(64, 64\\)"):
        engine.update_weights({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 63)})
    assert engine.weight_version == "0" and greedy(engine, prompts) == before


@pytest.mark.parametrize(("family", "forward"), [("llama", "fused"), ("llama", "transformers"), ("gpt2", "auto")])
def test_sleep_level_2_with_packed_projections_wakes_on_the_version_in_force(family: str, forward: str, tmp_path: Any) -> None:
    from safetensors.torch import save_file

    prompts = rollout_prompts(4)
    engine = Engine(model_of(family, 0, torch.float32), None, config("onednn", forward))
    new = {k: v.clone().contiguous() for k, v in model_of(family, 1, torch.float32).state_dict().items()}
    if family == "gpt2":  # safetensors keeps one name of a shared tensor
        new.pop("lm_head.weight")
    save_file(new, str(tmp_path / "model.safetensors"))
    engine.update_weights(tmp_path)
    engine.sleep(2)
    engine.wake_up()  # the folder read back into the parameters and the packed projections
    want = greedy(Engine(model_of(family, 1, torch.float32), None, config("onednn", forward)), prompts)
    assert greedy(engine, prompts) == want
    engine.sleep(2)  # an update while asleep: every weight given
    engine.update_weights(model_of(family, 0, torch.float32).state_dict(), version=3)
    engine.wake_up()
    assert greedy(engine, prompts) == greedy(Engine(model_of(family, 0, torch.float32), None, config("onednn", forward)), prompts)
