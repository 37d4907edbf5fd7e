"""The RL lifecycle on `Engine` (pagedkv.engine.lifecycle): update_weights, pause / resume, sleep / wake_up.

The stale-KV tests cannot pass by luck: the new weights are another seed's (every output changes), the
control run with `flush_cache=False` must serve stale KV and differ, and the cache (device and host tier)
must have served hits in the run that is checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedkv.core.errors import EngineStateError, InvalidArgumentError, NotSupportedError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.events import AllBlocksCleared, BlockRemoved
from pagedkv.hf.tiny import VOCAB, tiny_model

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def rollout_prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    """GRPO-shaped: prompts that share a 12-token system prefix, each with its own tail."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, VOCAB, size=12).tolist()
    return [system + rng.integers(3, VOCAB, size=int(rng.integers(3, 9))).tolist() for _ in range(n)]


def config(**kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(num_blocks=24, block_size=4, host_blocks=64, linear_backend="torch")
    return EngineConfig(**{**base, **kw})


def new_weights() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_model("llama", seed=1).state_dict().items()}


def fresh(prompts: list[list[int]], params: SamplingParams = GREEDY, **kw: Any) -> list[list[int]]:
    engine = Engine(tiny_model("llama", seed=1), None, config(**kw))
    return [o.output_token_ids for o in engine.generate(prompts, params)]


def run_rounds(engine: Engine, prompts: list[list[int]], rounds: int = 2) -> list[Any]:
    outs: list[Any] = []
    for _ in range(rounds):
        outs = engine.generate(prompts, GREEDY)
    return outs


@pytest.mark.parametrize("flush", [True, False])
def test_after_update_every_output_is_a_fresh_engine_s_on_the_new_weights(flush: bool) -> None:
    prompts = rollout_prompts()
    engine = Engine(tiny_model("llama", seed=0), None, config())
    old = [o.output_token_ids for o in run_rounds(engine, prompts)]  # the device and host tier fill up
    assert engine.tiering is not None and engine.tiering.stats.cached_tokens["CPU"] > 0
    report = engine.update_weights(new_weights(), flush_cache=flush)
    assert report.weight_version == "1" and report.flushed is flush
    outs = run_rounds(engine, prompts)
    got = [o.output_token_ids for o in outs]
    want = fresh(prompts)
    assert want != old  # the new weights change every rollout: stale KV would show
    assert all(o.weight_version == "1" for o in outs)
    assert sum(o.num_cached_tokens for o in outs) > 0  # the prefix cache served the second round
    if flush:
        assert got == want
    else:  # the control: KV of the old weights served under the new ones gives other tokens
        assert got != want
    engine.manager.check_invariants()


def test_update_from_a_safetensors_folder_and_misuse_changes_nothing(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(new_weights(), str(tmp_path / "model.safetensors"))
    prompts = rollout_prompts(4)
    engine = Engine(tiny_model("llama", seed=0), None, config())
    before = [o.output_token_ids for o in engine.generate(prompts, GREEDY)]
    with pytest.raises(InvalidArgumentError, match="no parameter"):
        engine.update_weights({"lm_head.weight.x": torch.zeros(1)})
    with pytest.raises(InvalidArgumentError, match="is \\(2,\\)"):
        engine.update_weights({"lm_head.weight": torch.zeros(2)})
    with pytest.raises(InvalidArgumentError, match="not a folder"):
        engine.update_weights(tmp_path / "nothing")
    assert engine.weight_version == "0"
    assert [o.output_token_ids for o in engine.generate(prompts, GREEDY)] == before
    assert engine.update_weights(tmp_path, "step-7").weight_version == "step-7"
    outs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == fresh(prompts)
    assert {o.weight_version for o in outs} == {"step-7"}
    with pytest.raises(InvalidArgumentError, match="not a number"):
        engine.update_weights(tmp_path)  # no next version after "step-7" without one


def continuation(prompts: list[list[int]], done: list[list[int]], total: int) -> list[list[int]]:
    """What a fresh engine on the new weights generates after prompt + the tokens already out."""
    rest = [SamplingParams(max_new_tokens=total - len(d), ignore_eos=True) for d in done]
    engine = Engine(tiny_model("llama", seed=1), None, config())
    outs = engine.generate([p + d for p, d in zip(prompts, done)], rest)
    return [d + o.output_token_ids for d, o in zip(done, outs)]


def test_an_update_while_requests_stream_recomputes_their_kv_under_the_new_weights() -> None:
    prompts = rollout_prompts(4)
    engine = Engine(tiny_model("llama", seed=0), None, config())
    streamed: dict[str, list[int]] = {}
    ids = [engine.add_request(p, GREEDY, on_token=lambda o: streamed.__setitem__(o.request_id, o.output_token_ids))
           for p in prompts]  # fmt: skip
    for _ in range(4):
        engine.step()
    done = [list(streamed[i]) for i in ids]
    assert all(0 < len(d) < 8 for d in done)
    assert engine.update_weights(new_weights()).num_parked == 4
    engine.run()
    outs = [engine.output(i) for i in ids]
    assert [o.output_token_ids for o in outs] == continuation(prompts, done, 8)
    assert all(o.weight_version == "1" and o.finish_reason == "length" for o in outs)


def test_pause_abort_ends_requests_with_their_tokens_and_closes_the_door() -> None:
    engine = Engine(tiny_model("llama", seed=0), None, config())
    ids = [engine.add_request(p, GREEDY) for p in rollout_prompts(3)]
    for _ in range(3):
        engine.step()
    assert sorted(engine.pause("abort")) == sorted(ids)
    ended = {o.request_id: o for o in engine.step()}
    assert {ended[i].finish_reason for i in ids} == {"abort"} and all(ended[i].output_token_ids for i in ids)
    with pytest.raises(EngineStateError, match="paused"):
        engine.add_request([5, 6, 7], GREEDY)
    engine.resume()
    assert engine.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "length"
    assert engine.manager.num_used_blocks == 0


def test_pause_wait_finishes_what_runs_and_admits_nothing() -> None:
    engine = Engine(tiny_model("llama", seed=0), None, config())
    ids = [engine.add_request(p, GREEDY) for p in rollout_prompts(2)]
    engine.step()
    engine.pause("wait")
    with pytest.raises(EngineStateError):
        engine.generate([[5, 6, 7]], GREEDY)
    engine.run()
    assert [engine.output(i).finish_reason for i in ids] == ["length", "length"]
    assert all(len(engine.output(i).output_token_ids) == 8 for i in ids)


@pytest.mark.parametrize("update", [False, True])
def test_pause_keep_freezes_then_goes_on_never_reusing_kv_across_versions(update: bool) -> None:
    prompts = rollout_prompts(3)
    engine = Engine(tiny_model("llama", seed=0), None, config())
    streamed: dict[str, list[int]] = {}
    ids = [engine.add_request(p, GREEDY, on_token=lambda o: streamed.__setitem__(o.request_id, o.output_token_ids))
           for p in prompts]  # fmt: skip
    for _ in range(3):
        engine.step()
    done = [list(streamed[i]) for i in ids]
    engine.pause("keep")
    assert engine.is_frozen and engine.manager.num_used_blocks == 0
    for _ in range(3):
        assert engine.step() == []
    assert [list(streamed[i]) for i in ids] == done  # frozen: not one token more
    if update:
        engine.update_weights(new_weights())
    engine.resume()
    engine.run()
    got = [engine.output(i).output_token_ids for i in ids]
    if update:
        assert got == continuation(prompts, done, 8)
    else:  # the same weights: exactly the uninterrupted rollout
        plain = Engine(tiny_model("llama", seed=0), None, config())
        assert got == [o.output_token_ids for o in plain.generate(prompts, GREEDY)]


def test_sleep_level_1_releases_kv_and_wake_up_serves_the_same() -> None:
    prompts = rollout_prompts(4)
    engine = Engine(tiny_model("llama", seed=0), None, config())
    before = [o.output_token_ids for o in run_rounds(engine, prompts)]
    kv = engine.cache.storage.data.numel() * engine.cache.storage.data.element_size()
    engine.add_request(prompts[0], GREEDY)
    with pytest.raises(EngineStateError, match="in flight"):
        engine.sleep(1)
    engine.pause("abort")
    engine.step()
    report = engine.sleep(1)
    assert report.kv_bytes == kv + 64 * engine.tiering.store.layout.nbytes  # type: ignore[union-attr]
    assert engine.cache.storage.data.numel() == 0 and engine.manager.num_used_blocks == 0
    with pytest.raises(EngineStateError, match="asleep"):
        engine.add_request(prompts[0], GREEDY)
    with pytest.raises(EngineStateError, match="asleep"):
        engine.resume()
    wake = engine.wake_up()
    assert wake.level == 1 and engine.cache.storage.data.numel() * engine.cache.storage.data.element_size() == kv
    engine.resume()
    outs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == before
    assert sum(o.num_cached_tokens for o in outs[:1]) == 0  # nothing survived the sleep


def test_sleep_level_2_drops_weights_and_reloads_the_version_in_force(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    prompts = rollout_prompts(4)
    engine = Engine(tiny_model("llama", seed=0), None, config())
    with pytest.raises(NotSupportedError, match="no folder"):
        engine.sleep(2)  # the weights would be lost: refused, nothing changed
    assert engine.lifecycle.sleep_level == 0 and engine.cache.storage.data.numel() > 0
    save_file(new_weights(), str(tmp_path / "model.safetensors"))
    engine.update_weights(tmp_path)
    report = engine.sleep(2)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert report.weight_bytes == weights
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    engine.wake_up()
    assert [o.output_token_ids for o in engine.generate(prompts, GREEDY)] == fresh(prompts)
    engine.sleep(2)  # an update while asleep brings every weight back
    with pytest.raises(InvalidArgumentError, match="give all of them"):
        engine.update_weights({"lm_head.weight": torch.zeros(VOCAB, 64)})
    engine.update_weights(tiny_model("llama", seed=0).state_dict(), version=3)
    engine.wake_up()
    plain = Engine(tiny_model("llama", seed=0), None, config())
    assert [o.output_token_ids for o in engine.generate(prompts, GREEDY)] == [
        o.output_token_ids for o in plain.generate(prompts, GREEDY)
    ]


def test_the_events_say_the_update_cleared_every_medium() -> None:
    from pagedkv.events.wire import CPU

    engine = Engine(tiny_model("llama", seed=0), None, config(kv_events=True))
    run_rounds(engine, rollout_prompts())
    engine.take_event_batch()
    assert engine.kv_events.log.holds(CPU)
    engine.update_weights(new_weights())
    batch = engine.take_event_batch()
    kinds = [type(e) for e in batch.events]
    assert AllBlocksCleared in kinds
    assert any(isinstance(e, BlockRemoved) and e.medium == CPU for e in batch.events)
    assert not engine.kv_events.log.holds(CPU) and not engine.kv_events.log.holds("GPU")


def test_the_tiers_fingerprint_carries_the_weight_version(tmp_path: Path) -> None:
    engine = Engine(tiny_model("llama", seed=0), None, config(disk_path=str(tmp_path), disk_bytes=1 << 20))
    run_rounds(engine, rollout_prompts(), rounds=1)
    before = {f.name for f in tmp_path.iterdir()}
    engine.update_weights(new_weights())
    after = {f.name for f in tmp_path.iterdir()}
    assert len(before) == len(after) == 1 and before != after  # the old file released, a new fingerprint
    engine.reset_prefix_cache()
    assert {f.name for f in tmp_path.iterdir()} == after  # same version, same fingerprint
    engine.close()


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_hybrid_engine_with_events_updates_and_says_so(family: str) -> None:
    """The hybrid allocator's event feed ends its epoch like the paged one: the update clears every group's
    blocks in the events, and no output after it reuses KV of the old weights."""
    prompts = rollout_prompts(4)
    kw = dict(allocator="hybrid", kv_events=True)
    engine = Engine(tiny_model(family, seed=0), None, config(**kw))
    run_rounds(engine, prompts)
    engine.take_event_batch()
    engine.update_weights({k: v.clone() for k, v in tiny_model(family, seed=1).state_dict().items()})
    kinds = [type(e) for e in engine.take_event_batch().events]
    assert AllBlocksCleared in kinds
    got = [o.output_token_ids for o in engine.generate(prompts, GREEDY)]
    want = [o.output_token_ids for o in Engine(tiny_model(family, seed=1), None, config(**kw)).generate(prompts, GREEDY)]
    assert got == want
