"""llama.cpp's Python server (`llama-cpp-python[server]`) as a peer: the GGUF file itself.

It answers one request at a time (requests queue behind a lock; one context, one sequence; by default a
new request interrupts the streaming one, so the bench turns that off: `--interrupt_requests False`): the bench
reports it as a serial server, not a batching peer. It serves the GGUF's own weights (SmolLM2's is Q4_1),
so its greedy text is not compared with the others'. Its context is the bench's KV budget in tokens
(`--n_ctx`), its batch the token budget per step (`--n_batch`), its threads the bench's (`--n_threads`,
`--n_threads_batch`). Between requests it keeps the previous prompt's KV and reuses the part the next
prompt shares with it (its only prefix reuse). It has no `ignore_eos`: EOS is banned with a logit bias
instead (`logit_bias: {EOS: -100}` in the body), which changes the text only where EOS would win.
Built with AMX off (install_peers.sh), its AMX path having crashed on a test machine.
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.bench.peers import Launch, Model, Peer, Settings, thread_env
from pagedkv.bench.serve_procs import free_port
from pagedkv.core.errors import InvalidArgumentError


def launch(model: Model, settings: Settings, workdir: Path, python: Path) -> Launch:
    if model.gguf is None:
        raise InvalidArgumentError("llama-cpp serves a .gguf file: pass --model smollm2 or a .gguf file")
    port = free_port()
    argv = [str(python), "-m", "llama_cpp.server", "--model", str(model.gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(settings.kv_tokens), "--n_batch", str(settings.max_num_batched_tokens),
            "--n_threads", str(settings.threads), "--n_threads_batch", str(settings.threads),
            "--interrupt_requests", "False"]  # fmt: skip
    config = {
        "dtype": "the GGUF's (Q4_1 weights for smollm2), f32 compute",
        "threads": settings.threads,
        "num_blocks": f"one context of {settings.kv_tokens} tokens",
        "block_size": "none (contiguous context)",
        "max_batch_tokens": settings.max_num_batched_tokens,
        "max_running": "1 (one request at a time)",
        "prefix_caching": "the previous request's matching prefix only",
        "admission_headroom": "none",
        "growth_reserve_tokens": "none",
        "preemption": "none (queued)",
        "attention": "llama.cpp (ggml CPU)",
        "ignore_eos": "logit_bias {EOS: -100} in the body",
        "weights": "the GGUF file",
        "process": "python -m llama_cpp.server (uvicorn)",
    }
    return Launch(argv, thread_env(settings.threads), port, eos_bias(model.eos_token_id), config)


def eos_bias(eos_token_id: int) -> dict[str, object]:
    """The request body fields that keep llama.cpp from stopping at EOS."""
    return {"logit_bias": {str(eos_token_id): -100.0}}


PEER = Peer("llama-cpp", "llama-cpp-python server (serial)", batching=False, same_weights=False,
            needs="llama_cpp.server", launch=launch)  # fmt: skip
