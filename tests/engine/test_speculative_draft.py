"""The draft-model proposer (`draft:PATH,k=3`): greedy output is token-identical with it and without
speculation, whether the draft is the target's own weights (everything accepted) or another random model
(little accepted), through chunked prefill and preemption; the draft's own blocks are all free once the
requests end (finished, aborted or preempted); the KV budget is split between target and draft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.engine.speculative import SpeculativeConfig
from pagedkv.hf.tiny import VOCAB, tiny_model

_TARGET: list[Any] = []


def target() -> Any:
    if not _TARGET:
        _TARGET.append(tiny_model("llama", 0))
    return _TARGET[0]


def _save(model: Any, folder: Path) -> Path:
    """`model` and a word-level tokenizer of its vocabulary, as a folder `pagedkv.hf.loading` loads."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = int(model.get_input_embeddings().num_embeddings)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def same(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The target's own weights, saved: a draft that agrees with it everywhere."""
    return str(_save(tiny_model("llama", 0), tmp_path_factory.mktemp("draft-same")))


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Another random model of the same vocabulary and a different shape (1 layer, 32 wide)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    return str(_save(LlamaForCausalLM(config), tmp_path_factory.mktemp("draft-other")))


@pytest.fixture(scope="module")
def close(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The target's weights with seeded noise (a tenth of their scale): it agrees with the target often, not
    always, so verifications accept part of a draft and the rest is rolled back."""
    import torch

    model = tiny_model("llama", 0)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.003)
    return str(_save(model, tmp_path_factory.mktemp("draft-close")))


def prompts(seed: int, lengths: tuple[int, ...] = (5, 17, 9, 30, 3)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def run(ps: list[list[int]], max_new: int, spec: SpeculativeConfig | None, **config: Any) -> tuple[Engine, list[Any]]:
    sched = {k: config.pop(k) for k in list(config) if k in SchedulerConfig.__dataclass_fields__}
    cfg = EngineConfig(**{"num_blocks": 64, "block_size": 4, **config}, scheduler=SchedulerConfig(**sched),
                       speculative=spec)  # fmt: skip
    engine = Engine(target(), None, cfg)
    outs = engine.generate(ps, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    engine.manager.check_invariants()
    assert engine.manager.num_used_blocks == 0, "speculation leaked target KV blocks"
    if engine.draft is not None:
        engine.draft.check_invariants()
        assert engine.draft.num_used_blocks == 0, "the draft model's blocks are not all free after the requests"
    return engine, outs


_REFS: dict[Any, list[list[int]]] = {}


def reference(ps: list[list[int]], max_new: int) -> list[list[int]]:
    key = (tuple(map(tuple, ps)), max_new)
    if key not in _REFS:
        _REFS[key] = [o.output_token_ids for o in run(ps, max_new, None, num_blocks=256)[1]]
    return _REFS[key]


def test_the_targets_own_weights_as_draft_accept_everything(same: str) -> None:
    ps = prompts(0)
    engine, outs = run(ps, 20, SpeculativeConfig("draft", 3, draft_model=same, budget=False))
    assert [o.output_token_ids for o in outs] == reference(ps, 20)
    spec = engine.stats.spec
    assert spec is not None and spec.num_drafts > 0
    assert spec.acceptance_rate == 1.0, spec.as_dict()
    assert engine.stats.num_steps < 20 // 2 + len(ps)  # about 4 tokens a step


def test_another_model_as_draft_accepts_little_and_changes_nothing(other: str) -> None:
    ps = prompts(1)
    engine, outs = run(ps, 16, SpeculativeConfig("draft", 4, draft_model=other, budget=False))
    assert [o.output_token_ids for o in outs] == reference(ps, 16)
    spec = engine.stats.spec
    assert spec is not None and spec.num_drafts > 0 and spec.acceptance_rate < 0.5, spec.as_dict()


def test_the_drafts_are_the_draft_models_own_greedy_continuation(close: str) -> None:
    """The draft's KV stays in step with the verified tokens (rejected drafts rolled back): every proposal
    equals what the draft model, run from scratch on the request's tokens, continues greedily."""
    import torch
    from transformers import AutoModelForCausalLM

    engine = Engine(target(), None, EngineConfig(num_blocks=64, block_size=4,
                                                 speculative=SpeculativeConfig("draft", 3, draft_model=close, budget=False)))  # fmt: skip
    assert engine.draft is not None
    seen: list[tuple[list[int], list[int]]] = []
    propose = engine.draft.propose

    def recording(requests: Any, num_tokens: Any) -> list[list[int]]:
        got = propose(requests, num_tokens)
        seen.extend((list(r.all_token_ids), d) for r, d in zip(requests, got))
        return got

    engine.draft.propose = recording  # type: ignore[method-assign]
    engine.generate(prompts(5, (9, 14)), SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert engine.stats.spec is not None and 0 < engine.stats.spec.num_accepted_tokens < engine.stats.spec.num_draft_tokens
    plain = AutoModelForCausalLM.from_pretrained(close, attn_implementation="eager").eval()
    assert len(seen) > 8
    with torch.no_grad():
        for tokens, drafts in seen:
            ids = list(tokens)
            for _ in drafts:
                ids.append(int(plain(torch.tensor([ids])).logits[0, -1].argmax()))
            assert ids[len(tokens) :] == drafts, (tokens, drafts)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_identical_through_chunking_and_preemption(same: str, close: str, mode: str) -> None:
    """13 blocks of 4 tokens for five requests: preemption; a 7-token step budget: chunked prefill."""
    ps = prompts(2)
    for draft in (same, close):
        engine, outs = run(ps, 14, SpeculativeConfig("draft", 3, draft_model=draft, budget=False), num_blocks=13,
                           max_num_batched_tokens=7, preemption_mode=mode)  # fmt: skip
        assert [o.output_token_ids for o in outs] == reference(ps, 14), draft
        assert engine.stats.num_preemptions > 0


def test_an_aborted_request_frees_its_draft_blocks(same: str) -> None:
    engine = Engine(target(), None, EngineConfig(num_blocks=64, block_size=4,
                                                 speculative=SpeculativeConfig("draft", 3, draft_model=same, budget=False)))  # fmt: skip
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True)) for p in prompts(3, (11, 6))]
    for _ in range(3):
        engine.step()
    assert engine.draft is not None and engine.draft.num_used_blocks > 0
    engine.finish(ids[0], "abort")
    engine.draft.check_invariants()
    engine.finish(ids[1], "abort")
    assert engine.draft.num_used_blocks == 0
    engine.run()


def test_the_kv_budget_is_split_between_target_and_draft(other: str) -> None:
    from pagedkv.hf.cache import cache_spec

    budget = 1 << 20
    engine = Engine(target(), None, EngineConfig(kv_budget_bytes=budget, block_size=4,
                                                 speculative=SpeculativeConfig("draft", 3, draft_model=other, budget=False)))  # fmt: skip
    assert engine.draft is not None
    per_target = cache_spec(engine.spec, None).bytes_per_block(4)
    per_draft = engine.draft.bytes_per_block
    assert 0 < per_draft < per_target  # the smaller model's blocks are smaller
    blocks = budget // (per_target + per_draft)  # each, the null block included
    assert engine.kv_budget_bytes == blocks * (per_target + per_draft) <= budget
    assert engine.draft.manager is not None and engine.draft.manager.num_blocks == engine.manager.num_blocks
    assert engine.manager.num_blocks == blocks - 1  # usable blocks: the null block is not handed out


def test_a_draft_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    import torch

    model = tiny_model("llama", 3)
    torch.manual_seed(0)
    model.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    folder = _save(model, tmp_path)
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        Engine(target(), None, EngineConfig(num_blocks=16, speculative=SpeculativeConfig("draft", 2, draft_model=str(folder), budget=False)))


def test_seeded_sampling_with_a_draft_repeats_itself(same: str) -> None:
    spec = SpeculativeConfig("draft", 3, draft_model=same, budget=False)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    got = []
    for _ in range(2):
        engine = Engine(target(), None, EngineConfig(num_blocks=64, block_size=4, speculative=spec))
        got.append([o.output_token_ids for o in engine.generate(prompts(4, (7, 12)), params)])
        assert engine.draft is not None and engine.draft.num_used_blocks == 0
    assert got[0] == got[1] and all(len(o) == 12 for o in got[0])


def _draft_kv_bytes(engine: Engine) -> int:
    assert engine.draft is not None and engine.draft.runner is not None
    cache = engine.draft.runner.cache
    tensors = (cache.storage.data, cache.storage.scales, cache.host, cache.host_scales)
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_the_drafts_kv_and_wake_up_serves_the_same(same: str, level: int) -> None:
    """Requests parked mid-generation (their draft sequences live) across sleep and wake_up: the draft's
    pages are released and counted in the report, every draft sequence is dropped with them (after the wake
    the draft still agrees with the target on every token: no proposal reads the released KV), and greedy
    outputs equal the ones before the sleep, token for token."""
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    spec = SpeculativeConfig("draft", 3, draft_model=same, budget=False)
    engine = Engine(tiny_model("llama", 0), None, EngineConfig(num_blocks=64, block_size=4, linear_backend="torch",
                                                               speculative=spec))  # fmt: skip
    if level == 2:  # on the CPU, level 2 reloads the weights from the folder that holds the version in force
        engine.update_weights(same)
    ps = prompts(6, (9, 14, 5))
    before = [o.output_token_ids for o in engine.generate(ps, params)]
    assert before == reference(ps, 16)
    ids = [engine.add_request(p, params) for p in ps]
    for _ in range(3):
        engine.step()
    engine.pause("keep")
    draft = engine.draft
    assert draft is not None and draft.runner is not None and draft.num_used_blocks > 0
    target_kv = engine.cache.storage.data.untyped_storage().nbytes() + engine.cache.host.untyped_storage().nbytes()
    draft_kv, shape = _draft_kv_bytes(engine), tuple(draft.runner.cache.storage.data.shape)
    assert draft_kv > 0
    report = engine.sleep(level)
    assert report.kv_bytes == target_kv + draft_kv
    assert _draft_kv_bytes(engine) == 0 and draft.released and draft.num_used_blocks == 0
    draft.check_invariants()
    engine.wake_up()
    assert not draft.released and tuple(draft.runner.cache.storage.data.shape) == shape
    assert _draft_kv_bytes(engine) == draft_kv and not draft.runner.cache.storage.data.any()
    spec_stats = engine.stats.spec
    assert spec_stats is not None
    drafted, accepted = spec_stats.num_draft_tokens, spec_stats.num_accepted_tokens
    engine.resume()
    ended: dict[str, list[int]] = {}
    engine.run(on_step=lambda outs: ended.update((o.request_id, o.output_token_ids) for o in outs))
    assert [ended[i] for i in ids] == before
    assert [o.output_token_ids for o in engine.generate(ps, params)] == before
    assert spec_stats.num_draft_tokens > drafted
    assert spec_stats.num_accepted_tokens - accepted == spec_stats.num_draft_tokens - drafted  # all accepted
    assert draft.num_used_blocks == 0
    draft.check_invariants()


def test_a_released_draft_refuses_to_propose(same: str) -> None:
    from pagedkv.core.errors import EngineStateError

    engine = Engine(target(), None, EngineConfig(num_blocks=16, block_size=4,
                                                 speculative=SpeculativeConfig("draft", 2, draft_model=same, budget=False)))  # fmt: skip
    assert engine.draft is not None
    assert engine.draft.release() > 0 and engine.draft.release() == 0  # twice: nothing more to give back
    with pytest.raises(EngineStateError, match="released"):
        engine.draft.propose([], [1])
    assert engine.draft.propose([], []) == []
    engine.draft.restore()
    assert not engine.draft.released


def test_the_draft_loads_on_the_targets_device_and_dtype(same: str) -> None:
    """A target on another device (here "meta", which any build has) gets its draft there, in its dtype."""
    import torch

    from pagedkv.engine.speculative.draft import DraftModelProposer

    model = tiny_model("llama", 0).to(device="meta", dtype=torch.bfloat16)
    proposer = DraftModelProposer.load(SpeculativeConfig("draft", 3, draft_model=same, budget=False), model,
                                       EngineConfig(num_blocks=16, block_size=4))  # fmt: skip
    param = next(proposer.model.parameters())
    assert (param.device.type, param.dtype) == ("meta", torch.bfloat16)
