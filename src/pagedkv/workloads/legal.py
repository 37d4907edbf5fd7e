"""`legal_contract`: long contracts in, short answers out, with prompt lengths from CUAD's published figures.

The workload: a reviewer sends a whole commercial contract and asks one question about it (which clauses
govern X?); the answer is a few hundred tokens. Lengths only: token ids are seeded random, as in every other
generator of `pagedkv.workloads`.

Where the prompt lengths come from. CUAD (D. Hendrycks, C. Burns, A. Chen, S. Ball, "CUAD: An
Expert-Annotated NLP Dataset for Legal Contract Review", NeurIPS 2021 Datasets and Benchmarks,
arXiv:2103.06268; CC BY 4.0) is 510 commercial contracts from SEC EDGAR. It publishes no token counts. What
it does publish, and what we use:

1. Mean size. The dataset card of `theatticusproject/cuad-qa` on Hugging Face (`dataset_info`) gives
   `dataset_size: 1664581107` bytes for `22450` train + `4182` test examples, each example holding one
   whole contract as its `context` plus one question: 1,664,581,107 / 26,632 = 62,503 bytes per example.
   This is a mean over (contract, question) examples, not over contracts: contracts with more examples
   (more annotated clauses) weigh more. It also counts the question and answer text (a few hundred bytes).
2. Bytes to tokens: OpenAI's rule of thumb "one token generally corresponds to ~4 characters of common
   English text" ("What are tokens and how to count them?", help.openai.com). Contracts are ASCII, so
   bytes = characters: 62,503 / 4 = 15,626 tokens on average. This is the one conversion we assume; a
   Llama or Qwen tokenizer may differ by tens of percent on legal text.
3. Spread. The paper (Section 3, "Dataset Statistics", and Figure 2, a histogram of pages per contract
   whose axis runs from 1 to 150 pages) says the contracts range "from a few pages to well over one hundred
   pages". It gives no quantiles; we read the range as 2 to 150 pages between the 1st and 99th percentiles
   of a log-normal (our assumption): sigma = ln(150 / 2) / (2 x 2.326) = 0.928.

So ln(prompt tokens) ~ N(mu, 0.928) with the mean fixed at 15,626 tokens: mu = ln(15626) - 0.928^2 / 2 =
9.226 (median 10,160 tokens). Prompts longer than `max_prompt_len` are truncated to it (the client cuts
the contract to fit the model's context, as a serving engine would refuse it otherwise); `truncated` in
`legal_stats` counts them.

Outputs: the issue asks for "a few hundred tokens"; we use the output lengths of a real service, the Azure
conv 2023 trace fit (`AZURE_CONV_OUTPUT_LOGNORMAL`, median 151, mean about 220 tokens), not a legal
corpus (CUAD has extractive answers, no generated ones).
"""

from __future__ import annotations

import math

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.workloads.generators import (
    AZURE_CONV_OUTPUT_LOGNORMAL,
    GeneratedRequest,
    _check_count,
    _check_len,
    _tokens,
    lognormal_lengths,
    poisson_arrivals,
)

# The published figures (module docstring) and what we derive from them.
CUAD_DATASET_BYTES = 1_664_581_107  # Hugging Face dataset card, theatticusproject/cuad-qa, dataset_size
CUAD_EXAMPLES = 22_450 + 4_182  # same card: train + test examples, one whole contract each
CHARS_PER_TOKEN = 4.0  # OpenAI's rule of thumb for English text
CUAD_PAGE_RANGE = (2.0, 150.0)  # paper: "a few pages" to "well over one hundred"; Fig. 2 axis ends at 150
Z_99 = 2.3263  # the 99th percentile of N(0, 1)

CUAD_MEAN_PROMPT_TOKENS = CUAD_DATASET_BYTES / CUAD_EXAMPLES / CHARS_PER_TOKEN  # 15,626
CUAD_PROMPT_SIGMA = math.log(CUAD_PAGE_RANGE[1] / CUAD_PAGE_RANGE[0]) / (2 * Z_99)  # 0.928
CUAD_PROMPT_MU = math.log(CUAD_MEAN_PROMPT_TOKENS) - CUAD_PROMPT_SIGMA**2 / 2  # 9.226
CUAD_PROMPT_LOGNORMAL = (CUAD_PROMPT_MU, CUAD_PROMPT_SIGMA)


def legal_contract(
    num_requests: int,
    *,
    seed: int = 0,
    rate: float | None = None,
    max_prompt_len: int | None = None,
    min_prompt_len: int = 256,
    output_lognormal: tuple[float, float] = AZURE_CONV_OUTPUT_LOGNORMAL,
    max_output_len: int | None = None,
) -> list[GeneratedRequest]:
    """Contracts with CUAD-derived lengths (module docstring), each truncated to `max_prompt_len` tokens
    and at least `min_prompt_len` (a one-page contract), and short answers; private prompts."""
    _check_count(num_requests)
    _check_len(min_prompt_len, "min_prompt_len")
    if max_prompt_len is not None:
        _check_len(max_prompt_len, "max_prompt_len")
        if max_prompt_len < min_prompt_len:
            raise InvalidArgumentError(
                f"max_prompt_len={max_prompt_len} is below min_prompt_len={min_prompt_len}: no contract fits"
            )
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(num_requests, rate, rng)
    prompts = lognormal_lengths(
        rng, num_requests, *CUAD_PROMPT_LOGNORMAL, low=min_prompt_len, high=max_prompt_len
    )
    outputs = lognormal_lengths(rng, num_requests, *output_lognormal, high=max_output_len)
    return [
        GeneratedRequest(i, float(arrivals[i]), _tokens(rng, int(prompts[i])), _tokens(rng, int(outputs[i])))
        for i in range(num_requests)
    ]


def legal_stats(requests: list[GeneratedRequest], max_prompt_len: int | None = None) -> dict[str, float]:
    """Mean/median/p99 prompt and output tokens of a legal workload, and how many prompts hit the cap."""
    if not requests:
        raise InvalidArgumentError("legal_stats: no requests")
    p = np.array([r.prompt_len for r in requests], dtype=np.float64)
    o = np.array([r.output_len for r in requests], dtype=np.float64)
    return {
        "prompt_mean": float(p.mean()),
        "prompt_median": float(np.median(p)),
        "prompt_p99": float(np.percentile(p, 99)),
        "output_mean": float(o.mean()),
        "output_median": float(np.median(o)),
        "truncated": float((p >= max_prompt_len).sum()) if max_prompt_len is not None else 0.0,
    }
