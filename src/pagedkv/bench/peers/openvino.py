"""OpenVINO GenAI as a peer: the converted folder exported to OpenVINO IR, served by our shim.

OpenVINO GenAI has no HTTP server, so the bench runs `openvino_shim.py` (a thin OpenAI server over its
ContinuousBatchingPipeline, in this package) with the peer's own python; every report names it a shim.
The model is exported once per converted folder with optimum-intel (`optimum-cli export openvino
--weight-format fp32`, cached under `$PAGEDKV_PEERS_DIR/openvino/models/`); `--dtype bf16` runs those
weights with `INFERENCE_PRECISION_HINT=bf16` (OpenVINO converts them at load). Its threads are
`INFERENCE_NUM_THREADS`; its KV budget is the bench's in tokens, in OpenVINO's CPU blocks of 32 tokens, the
KV cache kept in the compute precision (`KV_CACHE_PRECISION`, not its default u8 compression).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from pagedkv.bench.peers import Launch, Model, Peer, Settings, peers_root, thread_env

SHIM = Path(__file__).with_name("openvino_shim.py")
OV_CPU_BLOCK_TOKENS = 32  # as openvino_shim.OV_CPU_BLOCK_TOKENS (the shim imports nothing from pagedkv)
_DONE = "pagedkv-export-complete"


def export(model: Model, python: Path) -> Model:
    """`model` with its folder replaced by its OpenVINO IR (fp32 weights), exported on first use into
    `<peers>/openvino/models/<folder name>-<hash of its path>-fp32`."""
    weights = model.folder / "model.safetensors"  # the bench's folder links to the cached conversion's files
    source = weights.resolve().parent if weights.exists() else model.folder.resolve()
    key = hashlib.sha256(str(source).encode()).hexdigest()[:16]
    out = peers_root() / "openvino" / "models" / f"{source.name[:24]}-{key}-fp32"
    if (out / _DONE).is_file():
        return replace(model, folder=out)
    shutil.rmtree(out, ignore_errors=True)
    print(f"[bench serve] openvino: exporting {model.folder} to OpenVINO IR once ({out})", file=sys.stderr, flush=True)
    cli = python.parent / "optimum-cli"
    done = subprocess.run([str(cli), "export", "openvino", "--model", str(model.folder), "--task",
                           "text-generation-with-past", "--weight-format", "fp32", str(out)],
                          capture_output=True, text=True, env=_export_env())  # fmt: skip
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"openvino: optimum-cli export failed ({done.returncode}):\n{tail}")
    (out / _DONE).write_text(f"{model.folder}\n")
    return replace(model, folder=out)


def _export_env() -> dict[str, str]:
    from pagedkv.bench.serve_procs import server_env

    return server_env()


def launch(model: Model, settings: Settings, workdir: Path, python: Path) -> Launch:
    ir = model.folder  # the IR `export` made
    precision = "bf16" if settings.dtype == "bfloat16" else "f32"
    # -P: the shim's folder must not lead sys.path, or `import openvino` would find this module, not OpenVINO
    argv = [str(python), "-P", str(SHIM), "--model", str(ir), "--host", "127.0.0.1", "--port", "0",
            "--threads", str(settings.threads), "--num-kv-tokens", str(settings.kv_tokens),
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
            "--max-num-seqs", str(settings.max_num_seqs), "--precision", precision]  # fmt: skip
    if not settings.prefix_caching:
        argv.append("--no-prefix-caching")
    blocks = -(-settings.kv_tokens // OV_CPU_BLOCK_TOKENS)
    config = {
        "dtype": f"{settings.dtype} (fp32 IR, INFERENCE_PRECISION_HINT={precision})",
        "threads": f"{settings.threads} (INFERENCE_NUM_THREADS)",
        "num_blocks": f"{blocks} blocks of {OV_CPU_BLOCK_TOKENS} tokens ({settings.kv_tokens} tokens)",
        "block_size": OV_CPU_BLOCK_TOKENS,
        "max_batch_tokens": settings.max_num_batched_tokens,
        "max_running": settings.max_num_seqs,
        "prefix_caching": settings.prefix_caching,
        "admission_headroom": "none",
        "growth_reserve_tokens": "none",
        "preemption": "OpenVINO's scheduler (recompute or partial)",
        "attention": "OpenVINO CPU paged attention",
        "ignore_eos": "ignore_eos: true in the body (GenerationConfig.ignore_eos)",
        "weights": "the converted folder, exported to IR",
        "process": "openvino_shim.py: pagedkv's thin OpenAI shim over ContinuousBatchingPipeline (uvicorn)",
    }
    return Launch(argv, thread_env(settings.threads), None, {"ignore_eos": True}, config)


PEER = Peer("openvino", "OpenVINO GenAI ContinuousBatchingPipeline behind pagedkv's OpenAI shim",
            batching=True, same_weights=True, needs="openvino_genai", launch=launch, prepare=export)  # fmt: skip
