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

`--soak-chaos` sends hostile traffic instead, in a fixed rotation (`CHAOS_KINDS`): well-formed requests
streamed and not, streams the client leaves after the first event, non-streamed requests it gives up on,
malformed JSON, wrongly typed fields, a text prompt of `--soak-chaos-prompt-bytes` (refused before it is
tokenized), a multi-prompt request with one invalid prompt, a body the client stops sending half-way, a
stream asked over HTTP/1.0, a trailing-slash path, n = 3 with stop strings and logprobs, and bursts of
`--soak-concurrency` streams at once. Each kind has the answer it must get (an error counts otherwise), and
the same slope is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    group.add_argument("--soak-chaos", action="store_true",
                       help="hostile traffic: disconnects, malformed bodies, huge prompts, bursts (see the docs)")  # fmt: skip
    group.add_argument("--soak-chaos-prompt-bytes", type=int, default=1 << 20,
                       help="size of the chaos run's oversized text prompts (refused before tokenizing)")  # fmt: skip


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
                      prompt_words=args.soak_prompt_words,
                      chaos_prompt_bytes=args.soak_chaos_prompt_bytes if args.soak_chaos else None)  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        print_soak(result)
    return 0 if result["errors"] == 0 else 1


def _soak_problem(args: argparse.Namespace) -> str | None:
    if min(args.soak, args.soak_concurrency, args.soak_sample_every, args.soak_prompt_words) < 1:
        return "--soak, --soak-concurrency, --soak-sample-every and --soak-prompt-words must be >= 1"
    if args.soak_chaos_prompt_bytes < 1:
        return "--soak-chaos-prompt-bytes must be >= 1"
    if args.soak_warmup < 0:
        return "--soak-warmup must be >= 0"
    if args.soak <= args.soak_warmup + 2 * args.soak_sample_every:
        return "--soak must exceed --soak-warmup by at least two samples (--soak-sample-every)"
    return None


def _soak_options(args: argparse.Namespace) -> list[str]:
    return ["--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size)]


def soak(
    folder: Path, num_requests: int, workdir: Path, *, concurrency: int, sample_every: int, warmup: int,
    tolerance_bytes: int, options: list[str], prompt_words: int = 6, chaos_prompt_bytes: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the soak against a fresh `pagedkv serve` of `folder`; the samples, the slope and the verdict.
    With `chaos_prompt_bytes` the traffic is the chaos rotation (see the module docstring)."""
    server = procs.start_server("pagedkv-serve-soak", procs.pagedkv_argv(str(folder), options), workdir)
    try:
        start = time.perf_counter()
        samples, errors, first_error = asyncio.run(
            _drive(server, num_requests, concurrency, sample_every, _vocab_words(folder), prompt_words,
                   chaos_prompt_bytes=chaos_prompt_bytes)  # fmt: skip
        )
        wall = time.perf_counter() - start
    finally:
        procs.stop_server(server)
    result = soak_figures(samples, errors, first_error, wall, warmup, tolerance_bytes, str(folder))
    result["chaos"] = chaos_prompt_bytes is not None
    return result


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
    *,
    chaos_prompt_bytes: int | None = None,
) -> tuple[list[tuple[int, int]], int, str | None]:
    """Send the requests, `concurrency` at a time (the chaos rotation with `chaos_prompt_bytes`); RSS
    samples as (requests done, bytes)."""
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
            if chaos_prompt_bytes is None:
                error = await _soak_request(client, server.model_id, prompt, 2 + i % 7, stream=i % 2 == 0)
            else:
                chaos = _Chaos(client, server.model_id, server.base_url, concurrency, chaos_prompt_bytes)
                error = await chaos.request(CHAOS_KINDS[i % len(CHAOS_KINDS)], prompt, 2 + i % 7)
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


CHAOS_KINDS = (
    "complete", "stream", "leave_stream", "bad_json", "bad_type", "huge_prompt", "complete", "invalid_prompt",
    "cut_body", "give_up", "http10_stream", "trailing_slash", "stream", "n3_stop_logprobs", "burst",
)  # fmt: skip


@dataclass(slots=True)
class _Chaos:
    """One chaos request of each kind, with the answer it must get: None, or what went wrong."""

    client: Any
    model: str
    base_url: str
    burst_size: int
    huge_bytes: int

    async def request(self, kind: str, prompt: str, max_tokens: int) -> str | None:
        try:
            return await getattr(self, kind)(prompt, max_tokens)
        except Exception as err:  # counted, not raised: the soak measures the server, whatever it answers
            return f"{kind}: {type(err).__name__}: {str(err)[:200]}"

    def _body(self, prompt: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, **extra}  # fmt: skip

    async def _status(self, kind: str, want: int, path: str, **kwargs: Any) -> str | None:
        response = await self.client.post(path, **kwargs)
        ok = response.status_code == want and (want == 200 or "error" in response.json())
        return None if ok else f"{kind}: HTTP {response.status_code} (want {want}): {response.text[:200]}"

    async def complete(self, prompt: str, max_tokens: int) -> str | None:
        return await _soak_request(self.client, self.model, prompt, max_tokens, stream=False)

    async def stream(self, prompt: str, max_tokens: int) -> str | None:
        return await _soak_request(self.client, self.model, prompt, max_tokens, stream=True)

    async def leave_stream(self, prompt: str, max_tokens: int) -> str | None:
        body = self._body(prompt, 64, stream=True)
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    return None  # leaves after the first event: the server must abort the request
        return "leave_stream: no event before the end"

    async def give_up(self, prompt: str, max_tokens: int) -> str | None:
        import httpx

        with contextlib.suppress(httpx.TimeoutException):  # the client gives up: the server must abort it
            await self.client.post("/v1/completions", json=self._body(prompt, 64), timeout=0.02)
        return None

    async def bad_json(self, prompt: str, max_tokens: int) -> str | None:
        content = b'{"model": "' + prompt.encode() + b'", "prompt": '
        return await self._status("bad_json", 400, "/v1/completions", content=content,
                                  headers={"content-type": "application/json"})  # fmt: skip

    async def bad_type(self, prompt: str, max_tokens: int) -> str | None:
        return await self._status("bad_type", 400, "/v1/completions", json=self._body(prompt, str(max_tokens)))

    async def huge_prompt(self, prompt: str, max_tokens: int) -> str | None:
        huge = (prompt + " ") * (self.huge_bytes // (len(prompt) + 1) + 1)
        return await self._status("huge_prompt", 400, "/v1/completions", json=self._body(huge, max_tokens))

    async def invalid_prompt(self, prompt: str, max_tokens: int) -> str | None:
        body = self._body([[3, 4, 5], [10**9]], max_tokens)
        return await self._status("invalid_prompt", 400, "/v1/completions", json=body)

    async def trailing_slash(self, prompt: str, max_tokens: int) -> str | None:
        response = await self.client.get("/v1/models/")
        return None if response.status_code == 404 else f"trailing_slash: HTTP {response.status_code}"

    async def n3_stop_logprobs(self, prompt: str, max_tokens: int) -> str | None:
        body = self._body(prompt, max_tokens, n=3, temperature=1.0, seed=7, stop=["zz"], logprobs=2, stream=True)
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data:")]
        return None if lines and lines[-1].strip() == "data: [DONE]" else "n3_stop_logprobs: no [DONE]"

    async def burst(self, prompt: str, max_tokens: int) -> str | None:
        answers = await asyncio.gather(*(self.stream(f"{prompt} {i}", max_tokens) for i in range(self.burst_size)))
        return next((a for a in answers if a is not None), None)

    async def _raw(self, head: str, body: bytes, *, close_early: bool) -> bytes:
        host, port = self.base_url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(head.encode() + body)
            await writer.drain()
            return b"" if close_early else await reader.read()
        finally:
            writer.close()

    async def cut_body(self, prompt: str, max_tokens: int) -> str | None:
        data = json.dumps(self._body(prompt, max_tokens)).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data) * 2}\r\n\r\n")  # fmt: skip
        await self._raw(head, data, close_early=True)  # half the body, then gone
        return None

    async def http10_stream(self, prompt: str, max_tokens: int) -> str | None:
        data = json.dumps(self._body(prompt, max_tokens, stream=True)).encode()
        head = (f"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n")  # fmt: skip
        head_bytes = (await self._raw(head, data, close_early=False)).partition(b"\r\n\r\n")[0].lower()
        ok = b" 400 " in head_bytes.split(b"\r\n", 1)[0] and b"chunked" not in head_bytes
        return None if ok else f"http10_stream: {head_bytes[:200]!r}"


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
    print(f"pagedkv serve {'chaos ' if result.get('chaos') else ''}soak: {result['requests']} requests ({result['errors']} errors) in {result['wall_s']:.0f} s "
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
