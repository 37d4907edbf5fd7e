"""Verify one request's draft tokens against the target model's logits: which drafts are accepted, and the
one token the target adds after them.

Input: `logits [d + 1, V]`, row i scoring the position after the request's i-th token of the step (row 0
follows its last verified token, row i follows draft i - 1), and the `d` draft tokens. Output: the tokens
to append, `drafts[:a] + [t]` with `a` the accepted count (0..d) and `t` drawn from row `a`, so every
verification yields between 1 and d + 1 tokens.

Greedy (`temperature == 0`): accept while `argmax(row i) == drafts[i]`; `t = argmax(row a)`. Exactly the
tokens one-at-a-time greedy decoding produces (ties go to the lowest id, as in `sampler.sample`).

Sampled: speculative sampling (Leviathan et al. 2023, Chen et al. 2023), which leaves the target
distribution unchanged. `p_i` is row i after temperature, top-k and top-p (`filter_logits`), `q_i` the
proposer's distribution for draft i (one-hot for n-gram lookup, which proposes deterministically).
Draft i is accepted with probability `min(1, p_i(x) / q_i(x))`; at the first rejection `t` is drawn from
`norm(max(0, p_i - q_i))`, and after d acceptances from `p_d`. Every draw uses the request's own
generator, so a seeded request repeats itself run after run (its stream differs from a run without
speculation: the tokens follow the same distribution, not the same draws).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sampler import filter_logits


def verify(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """The tokens to append (see the module docstring). `draft_probs [d, V]` is the proposer's
    distribution per draft (None: deterministic proposals, one-hot)."""
    d = len(drafts)
    if logits.ndim != 2 or logits.shape[0] != d + 1:
        raise InvalidArgumentError(f"verify: {d} drafts need {d + 1} rows of logits, got {tuple(logits.shape)}")
    if draft_probs is not None and (draft_probs.ndim != 2 or draft_probs.shape[0] != d):
        raise InvalidArgumentError(f"verify: draft_probs must be [{d}, V], got {tuple(draft_probs.shape)}")
    if params.greedy:
        return verify_greedy(logits, drafts)
    out: list[int] = []
    for i, x in enumerate(drafts):
        p = filter_logits(logits[i], params.temperature, params.top_k, params.top_p).softmax(-1)
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        p_x = float(p[x])
        u = float(torch.rand(1, generator=generator).item())
        if q_x > 0 and u * q_x < p_x:  # accept with probability min(1, p/q)
            out.append(int(x))
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i].to(p.dtype)).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p is q: nothing to correct; `u < p/q` held unless rounding, so draw from p
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator).item()))
        return out
    p = filter_logits(logits[d], params.temperature, params.top_k, params.top_p).softmax(-1)
    out.append(int(torch.multinomial(p, 1, generator=generator).item()))
    return out


def verify_greedy(logits: torch.Tensor, drafts: Sequence[int]) -> list[int]:
    """Greedy verification: the drafts the argmax agrees with, then the argmax after them."""
    picks = [int(t) for t in logits.max(-1).indices.tolist()]
    a = 0
    while a < len(drafts) and picks[a] == int(drafts[a]):
        a += 1
    return [int(t) for t in drafts[:a]] + [picks[a]]
