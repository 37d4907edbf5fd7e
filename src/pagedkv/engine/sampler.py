"""Turn a step's logits into token ids, one row per sequence that samples this step.

Contract: `sample(logits, params, generators)` with `logits[i]` the last-position logits of sequence i,
`params[i]` its `SamplingParams` and `generators[i]` its own `torch.Generator` (or None when unseeded).
Greedy rows take the argmax; the others go temperature -> top-k -> top-p -> multinomial with their own
generator, so a seeded sequence draws the same tokens whatever else is in the batch.

Every row is checked before any row draws (a row with NaN or +inf logits, or no finite one, is refused with
`InvalidArgumentError` naming it), so a call that raises has consumed no generator's randomness: the
caller can drop the bad rows (`bad_rows`) and sample the rest with every seeded stream intact.

`token_logprobs` gives the log-probabilities a request asked for (`SamplingParams.logprobs`): of the raw
distribution, apart from the draw, so asking for them changes no sampled token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.params import SamplingParams

TINY_TEMPERATURE = 1e-30  # far above float32's smallest subnormal (1.4e-45), below any temperature meant as one


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for one sequence, or None (the global RNG) when it has no seed."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scaled logits of one row `[V]` with everything outside top-k and the top-p nucleus set to -inf.

    The row's maximum is subtracted first, so a tiny temperature scales finite gaps, never inf / inf."""
    row = logits.float()
    scaled = (row - row.max()) / temperature
    if temperature < TINY_TEMPERATURE:  # the divisor rounds to 0 in float32: the maxima are 0 / 0
        scaled = torch.nan_to_num(scaled, nan=0.0)  # the limit: the maxima at 0, everything else -inf
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token id per row of `logits` `[K, V]`; see the module docstring."""
    if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise InvalidArgumentError(
            f"sample: logits {tuple(logits.shape)} need one row per params ({len(params)}) and generator "
            f"({len(generators)})"
        )
    if logits.shape[0] == 0:
        return []
    # one pass gives the greedy picks and the check: a row's max is NaN, +inf or -inf exactly when the row
    # holds a NaN, holds +inf or has nothing finite (max propagates NaN)
    top, greedy = logits.max(-1)
    if not bool(torch.isfinite(top).all()):
        raise InvalidArgumentError(
            f"sample: rows {bad_rows(logits)} of the logits hold NaN or +inf (or nothing finite); cannot sample them"
        )
    if all(p.greedy for p in params):
        return [int(t) for t in greedy.tolist()]
    out: list[int] = []
    for i, p in enumerate(params):
        if p.greedy:
            out.append(int(greedy[i]))
            continue
        probs = filter_logits(logits[i], p.temperature, p.top_k, p.top_p).softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out


def bad_rows(logits: torch.Tensor) -> list[int]:
    """Rows of `[K, V]` logits that cannot be sampled: any NaN or +inf, or no finite value at all."""
    top = logits.amax(-1)  # NaN if the row holds one, +inf if it holds one, -inf if nothing is finite
    bad = ~torch.isfinite(top)
    return [int(i) for i in bad.nonzero().flatten().tolist()]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenLogprobs]:
    """For each row of `[R, V]` logits, the log-probability of `token_ids[row]` and the `k` most likely
    tokens' (raw distribution: no temperature or filtering), most likely first."""
    if logits.ndim != 2 or logits.shape[0] != len(token_ids):
        raise InvalidArgumentError(f"token_logprobs: logits {tuple(logits.shape)} need one row per token ({len(token_ids)})")
    if logits.shape[0] == 0:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.as_tensor(list(token_ids), dtype=torch.int64).view(-1, 1)).view(-1).tolist()
    top_vals, top_ids = (logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long()))
    out: list[TokenLogprobs] = []
    for row, token in enumerate(token_ids):
        top = tuple(zip((int(t) for t in top_ids[row].tolist()), (float(v) for v in top_vals[row].tolist())))
        out.append(TokenLogprobs(int(token), float(chosen[row]), top))
    return out
