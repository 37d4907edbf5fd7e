"""Speculative sampling keeps the target distribution (vLLM's rejection-sampler tests, on small vocabularies).

For a fixed target `p` and proposer `q`, drafts drawn from `q` and verified by `verify` must yield first
tokens distributed as `p` (whatever `q`: one-hot n-gram proposals, a close draft, a poor one), and the
token after an accepted draft distributed as the target's next row. The engine on the tiny model samples
a second token whose empirical distribution matches the exact one computed from the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sampler import filter_logits
from pagedkv.engine.speculative.rejection import verify, verify_greedy

V = 6
TRIALS = 6000


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return float(0.5 * np.abs(counts / counts.sum() - p).sum())


def _target(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, V, generator=g) * 1.5
    return logits, logits.softmax(-1)


@pytest.mark.parametrize("proposer", ["onehot", "close", "poor"])
def test_first_token_follows_the_target_whatever_the_proposer(proposer: str) -> None:
    logits, p = _target(1)
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=1.0, seed=0)
    if proposer == "onehot":
        q = None
    elif proposer == "close":
        q = (p[:2] * 0.8 + 0.2 / V).clone()
    else:
        q = torch.full((2, V), 0.02)
        q[:, 0] = 1 - 0.02 * (V - 1)
    first = np.zeros(V)
    second_after_accept = np.zeros(V)
    accepted = 0
    for _ in range(TRIALS):
        if q is None:
            drafts = [int(torch.multinomial(p[0], 1, generator=gen)) if _ % 3 else 0, 1]  # any fixed guesses
            tokens = verify(logits, drafts, params, gen)
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
            tokens = verify(logits, drafts, params, gen, draft_probs=q)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            accepted += 1
            second_after_accept[tokens[1]] += 1 if tokens[0] == drafts[0] else 0
    p0 = p[0].numpy()
    assert _tv(first, p0) < 0.03, (first / TRIALS, p0)
    assert accepted > 0


def test_the_token_after_an_accepted_draft_follows_the_next_row() -> None:
    """Condition on the first draft being accepted: the next token is distributed as row 1 (the draft is
    one-hot at the target's most likely token, so acceptances are frequent)."""
    logits, p = _target(2)
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, seed=0)
    top = int(p[0].argmax())
    counts = np.zeros(V)
    for _ in range(TRIALS):
        tokens = verify(logits[:2], [top], params, gen)
        if tokens[0] == top and len(tokens) == 2:
            counts[tokens[1]] += 1
    assert counts.sum() > TRIALS * float(p[0, top]) * 0.9
    assert _tv(counts, p[1].numpy()) < 0.04


def test_filters_apply_to_the_target() -> None:
    """top-k 2 at temperature 0.7: no token outside the target's top 2 is ever produced, and the
    frequencies follow the filtered distribution."""
    logits, _ = _target(4)
    params = SamplingParams(temperature=0.7, top_k=2, seed=0)
    filtered = filter_logits(logits[0], 0.7, 2, 1.0).softmax(-1).numpy()
    gen = torch.Generator().manual_seed(5)
    counts = np.zeros(V)
    for i in range(TRIALS // 2):
        counts[verify(logits[:2], [i % V], params, gen)[0]] += 1
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(filtered))
    assert _tv(counts, filtered) < 0.04


def test_greedy_verification_is_argmax_decoding() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    assert verify_greedy(logits, [1, 0]) == [1, 0, 2]
    assert verify_greedy(logits, [1, 2]) == [1, 0]
    assert verify_greedy(logits, [2, 0]) == [1]
    assert verify(logits, [1, 0], SamplingParams(), None) == [1, 0, 2]


class _FixedGuess:
    """Proposes one fixed token after the first output token (any proposer must leave p unchanged)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, requests: list[Any], num_tokens: list[int]) -> list[list[int]]:
        return [[self.token] for _ in requests]

    def forget(self, request_id: str) -> None:
        return None


def test_seeded_sampling_with_speculation_repeats_and_matches_the_model() -> None:
    """On the tiny model: a seeded request repeats itself, and the second token over many seeds, drafted by
    a proposer that guesses the likeliest one (accepted about 15% of the time, the residual drawn from
    otherwise), is distributed as the model's exact p(t2) = sum over t1 of p(t1) p(t2 | t1): its distance
    to p(t2) is within what a sample of the same size drawn from p(t2) itself shows."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.speculative import SpeculativeConfig
    from pagedkv.hf.tiny import tiny_model

    model = tiny_model("llama", 0)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    temp = 0.1  # about 20 likely tokens: a sample of 1000 resolves the distribution
    with torch.no_grad():
        p1 = (model(torch.tensor([prompt])).logits[0, -1] / temp).softmax(-1)
        rows = model(torch.tensor([prompt + [t] for t in range(p1.shape[0])])).logits[:, -1]
        p2 = (p1[:, None] * (rows / temp).softmax(-1)).sum(0).numpy().astype(np.float64)
    p2 /= p2.sum()
    cfg = EngineConfig(num_blocks=512, block_size=4, speculative=SpeculativeConfig(num_speculative_tokens=1, budget=False))

    def run(seeds: range) -> tuple[Engine, list[Any]]:
        engine = Engine(model, None, cfg)
        engine.proposer = _FixedGuess(int(p2.argmax()))
        params = [SamplingParams(max_new_tokens=3, temperature=temp, seed=s, ignore_eos=True) for s in seeds]
        return engine, engine.generate([prompt] * len(params), params)

    engine, outs = run(range(1000))
    _, again = run(range(8))
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outs[:8]]
    spec = engine.stats.spec
    assert spec is not None and 0.05 * spec.num_draft_tokens < spec.num_accepted_tokens < spec.num_draft_tokens
    counts = np.bincount([o.output_token_ids[1] for o in outs], minlength=len(p2)).astype(float)
    noise = np.random.default_rng(0).multinomial(len(outs), p2, size=20)
    bound = max(_tv(n.astype(float), p2) for n in noise)
    assert _tv(counts, p2) < 1.5 * bound, (_tv(counts, p2), bound)
