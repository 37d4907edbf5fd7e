"""sleep(level=2) releases the oneDNN-packed copies of the weights, not only the parameters.

The oneDNN backend multiplies against packed copies (`pagedkv.hf.cpu_linear.PackedLinear`): the model's own
projections (`pack_linears`, transformers' forward) or the fused forward's (`pagedkv.hf.fused_llama`, batch-
invariant mode's too). They are as large as the weights, so a level-2 sleep that kept them would give back
half of what it says. Checked here: every packed copy is released (its tensor emptied) and counted in
`SleepReport.weight_bytes`, and after `wake_up` (the folder read back) every output equals the one before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.cpu_linear import PackedLinear, packed_linears
from pagedkv.hf.tiny import tiny_model

from .test_lifecycle import rollout_prompts

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=0)


def packed_copies(engine: Engine) -> list[PackedLinear]:
    found = list(packed_linears(engine.model).values())
    fused = engine.runner.fused
    if fused is not None:
        for layer in fused.layers:
            found += [p for p in (layer.qkv, layer.o, layer.gate_up, layer.down) if isinstance(p, PackedLinear)]
        found += [fused.lm_head] if isinstance(fused.lm_head, PackedLinear) else []
    return found


def outputs(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return [(o.output_token_ids, [lp.logprob for lp in o.logprobs or []]) for o in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize(
    ("forward", "backend"), [("fused", "onednn"), ("transformers", "onednn"), ("fused", "invariant")]
)
def test_sleep_level_2_releases_the_packed_copies_and_wake_up_rebuilds_them(
    forward: str, backend: str, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    model = tiny_model("llama")
    save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    cfg = EngineConfig(num_blocks=32, block_size=4, linear_backend=backend, model_forward=forward)  # type: ignore[arg-type]
    engine = Engine(model, None, cfg)
    engine.update_weights(tmp_path, flush_cache=False)  # the folder holds the version in force
    prompts = rollout_prompts(4)
    before = outputs(engine, prompts)
    packed = packed_copies(engine)
    assert packed, "the engine packed nothing: the test would prove nothing"
    packed_bytes = sum(p.packed_weight.numel() * p.packed_weight.element_size() for p in packed)
    report = engine.sleep(2)
    assert all(p.released and p.packed_weight.numel() == 0 for p in packed_copies(engine))
    assert report.weight_bytes >= packed_bytes
    engine.wake_up()
    assert not any(p.released for p in packed_copies(engine))
    assert outputs(engine, prompts) == before


def test_a_released_projection_refuses_to_run_until_repacked() -> None:
    from pagedkv.core.errors import EngineStateError

    weight = torch.randn(6, 4)
    layer = PackedLinear(weight)
    x = torch.randn(3, 4)
    want = layer(x)
    assert layer.release() > 0 and layer.release() == 0
    with pytest.raises(EngineStateError, match="released"):
        layer(x)
    layer.repack(weight)
    assert torch.equal(layer(x), want)
