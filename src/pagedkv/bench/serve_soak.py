"""`pagedkv bench serve --soak N`: does a long-lived `pagedkv serve` keep its resident memory flat?

N short requests (prompts of `--soak-prompt-words` to 8 more tokens, default 6-14, each its own words, 2-8 output tokens, greedy, EOS ignored;
streamed and not streamed in turn) go through one `pagedkv serve` process, `--soak-concurrency` in flight
at a time, on a tiny random model by default (`tiny_folder`: `pagedkv.hf.tiny.tiny_model("llama")` saved
with a 128-word tokenizer, so the server does thousands of requests a minute and memory, not compute, is
what the run measures). The server's VmRSS is sampled every `--soak-sample-every` requests.

The figure is the slope after warm-up: a least-squares line through the samples taken after the first
`--soak-warmup` requests, in bytes per 1000 requests, with the RSS at the end of warm-up and at the end. A
server that keeps something per finished request (its outputs or ids, an event log, per-request metric
state, prefix index entries) shows it here as a steady positive slope; allocator noise shows as a slope of a
few KiB either way. `flat` is True when the fitted growth over the post-warm-up requests is below
`--soak-tolerance-bytes` (default 1 MiB, about 50 bytes a request at 20,000).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.bench import serve_procs as procs

TINY_WORDS = 125  # + <unk>, <s>, </s>: the tiny models' 128-token vocabulary


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("memory soak (--soak N)")
    group.add_argument("--soak-model", default=None, help="model folder for the soak (default: a tiny llama)")
    group.add_argument("--soak-concurrency", type=int, default=16, help="requests in flight at once")
    group.add_argument("--soak-prompt-words", type=int, default=6,
                       help="shortest prompt in words (prompts take 0-8 more; a word is 5 characters)")  # fmt: skip
    group.add_argument("--soak-sample-every", type=int, default=250, help="requests between RSS samples")
    group.add_argument("--soak-warmup", type=int, default=2000, help="requests before the slope is fitted")
    group.add_argument("--soak-tolerance-bytes", type=int, default=1 << 20,
                       help="fitted growth after warm-up below which memory counts as flat")  # fmt: skip


def tiny_folder(folder: Path, family: str = "llama", seed: int = 0) -> Path:
    """Save `tiny_model(family, seed)` with a word-level tokenizer of its 128 ids (0 <unk>, 1 <s>,
    2 </s>, then 125 lowercase words) into `folder`, loadable by both servers."""
    import itertools

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagedkv.hf.tiny import tiny_model

    model = tiny_model(family, seed)
    syllables = ["ba", "do", "ki", "lu", "me", "no", "pa", "ri", "so", "tu", "va", "ze"]
    words = ["".join(p) for p in itertools.product(syllables, repeat=2)][:TINY_WORDS]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)  # type: ignore[no-untyped-call]
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def run_soak_command(args: argparse.Namespace) -> int:
    problem = _soak_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pagedkv-serve-soak-") as tmp:
        folder = Path(args.soak_model) if args.soak_model else tiny_folder(Path(tmp) / "tiny")
        result = soak(folder, args.soak, Path(tmp), concurrency=args.soak_concurrency,
                      sample_every=args.soak_sample_every, warmup=args.soak_warmup,
                      tolerance_bytes=args.soak_tolerance_bytes, options=_soak_options(args),
                      prompt_words=args.soak_prompt_words)  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        print_soak(result)
    return 0 if result["errors"] == 0 else 1


def _soak_problem(args: argparse.Namespace) -> str | None:
    if min(args.soak, args.soak_concurrency, args.soak_sample_every, args.soak_prompt_words) < 1:
        return "--soak, --soak-concurrency, --soak-sample-every and --soak-prompt-words must be >= 1"
    if args.soak_warmup < 0:
        return "--soak-warmup must be >= 0"
    if args.soak <= args.soak_warmup + 2 * args.soak_sample_every:
        return "--soak must exceed --soak-warmup by at least two samples (--soak-sample-every)"
    return None


def _soak_options(args: argparse.Namespace) -> list[str]:
    return ["--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size)]


def soak(
    folder: Path, num_requests: int, workdir: Path, *, concurrency: int, sample_every: int, warmup: int,
    tolerance_bytes: int, options: list[str], prompt_words: int = 6,
) -> dict[str, Any]:  # fmt: skip
    """Run the soak against a fresh `pagedkv serve` of `folder`; the samples, the slope and the verdict."""
    server = procs.start_server("pagedkv-serve-soak", procs.pagedkv_argv(str(folder), options), workdir)
    try:
        start = time.perf_counter()
        samples, errors, first_error = asyncio.run(
            _drive(server, num_requests, concurrency, sample_every, _vocab_words(folder), prompt_words)
        )
        wall = time.perf_counter() - start
    finally:
        procs.stop_server(server)
    return soak_figures(samples, errors, first_error, wall, warmup, tolerance_bytes, str(folder))


def _vocab_words(folder: Path) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    texts = tok.batch_decode([[i] for i in range(len(tok))], skip_special_tokens=True)
    words = sorted({t.strip() for t in texts if t.strip().isalpha() and t.strip().islower()})
    return words or ["hello"]


@dataclass(slots=True)
class _Tally:
    done: int = 0
    errors: int = 0
    first_error: str | None = None


async def _drive(
    server: procs.ServerProcess,
    num_requests: int,
    concurrency: int,
    sample_every: int,
    words: list[str],
    prompt_words: int = 6,
) -> tuple[list[tuple[int, int]], int, str | None]:
    """Send the requests, `concurrency` at a time; RSS samples as (requests done, bytes)."""
    import httpx

    rng = np.random.default_rng(0)
    samples = [(0, procs.rss_bytes(server.pid))]
    tally = _Tally()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            prompt = " ".join(words[j] for j in rng.integers(0, len(words), size=prompt_words + i % 9))
            error = await _soak_request(client, server.model_id, prompt, 2 + i % 7, stream=i % 2 == 0)
            if error is not None:
                tally.errors += 1
                tally.first_error = tally.first_error or error
            tally.done += 1
            if tally.done % sample_every == 0:
                samples.append((tally.done, procs.rss_bytes(server.pid)))
                _progress(tally.done, num_requests, samples[-1][1])

    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return samples, tally.errors, tally.first_error


async def _soak_request(client: Any, model: str, prompt: str, max_tokens: int, *, stream: bool) -> str | None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    try:
        if not stream:
            response = await client.post("/v1/completions", json=body)
            return (
                None if response.status_code == 200 else f"HTTP {response.status_code}: {response.text[:200]}"
            )
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}"
            lines = [line async for line in response.aiter_lines() if line.startswith("data:")]
        return None if lines and lines[-1].strip() == "data: [DONE]" else "stream ended without [DONE]"
    except Exception as err:  # counted, not raised: the soak measures the server, whatever it answers
        return f"{type(err).__name__}: {str(err)[:200]}"


def _progress(done: int, total: int, rss: int) -> None:
    if sys.stderr.isatty():
        print(
            f"[bench serve --soak] {done}/{total} requests, RSS {rss / 2**20:.1f} MiB",
            file=sys.stderr,
            flush=True,
        )


def soak_figures(
    samples: list[tuple[int, int]], errors: int, first_error: str | None, wall_s: float, warmup: int,
    tolerance_bytes: int, model: str,
) -> dict[str, Any]:  # fmt: skip
    """The least-squares slope of RSS over requests after warm-up, and the verdict."""
    after = [(n, rss) for n, rss in samples if n >= warmup]
    slope = 0.0
    if len(after) >= 2:
        x = np.array([n for n, _ in after], dtype=float)
        y = np.array([rss for _, rss in after], dtype=float)
        slope = float(np.polyfit(x, y, 1)[0])
    span = (after[-1][0] - after[0][0]) if len(after) >= 2 else 0
    return {
        "model": model,
        "requests": samples[-1][0] if samples else 0,
        "errors": errors,
        "first_error": first_error,
        "wall_s": wall_s,
        "requests_per_s": (samples[-1][0] / wall_s) if samples and wall_s > 0 else 0.0,
        "warmup_requests": warmup,
        "rss_start_bytes": samples[0][1] if samples else None,
        "rss_after_warmup_bytes": after[0][1] if after else None,
        "rss_end_bytes": samples[-1][1] if samples else None,
        "slope_bytes_per_1000_requests": slope * 1000,
        "fitted_growth_after_warmup_bytes": slope * span,
        "flat": slope * span < tolerance_bytes,
        "tolerance_bytes": tolerance_bytes,
        "samples": samples,
    }


def print_soak(result: dict[str, Any]) -> None:
    mib = 2**20
    print(f"pagedkv serve soak: {result['requests']} requests ({result['errors']} errors) in {result['wall_s']:.0f} s "
          f"({result['requests_per_s']:.0f}/s) on {result['model']}")  # fmt: skip
    print(
        f"RSS: start {result['rss_start_bytes'] / mib:.1f} MiB, after {result['warmup_requests']} warm-up "
        f"requests {result['rss_after_warmup_bytes'] / mib:.1f} MiB, end {result['rss_end_bytes'] / mib:.1f} MiB"
    )
    print(f"slope after warm-up: {result['slope_bytes_per_1000_requests'] / 1024:.1f} KiB per 1000 requests "
          f"(fitted growth {result['fitted_growth_after_warmup_bytes'] / mib:.2f} MiB): "
          f"{'flat' if result['flat'] else 'GROWING'}")  # fmt: skip
    if result["first_error"]:
        print(f"first error: {result['first_error']}")
