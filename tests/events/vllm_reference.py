"""Block hashes computed by vLLM's own code (run with a Python that has cbor2; VLLM_SRC = a vLLM source tree).

    VLLM_SRC=.../vllm-0.33.0 PEER_PY -m ... python tests/events/vllm_reference.py   -> JSON on stdout

It loads `vllm/utils/hashing.py` (`sha256_cbor`) as a file, and takes `hash_block_tokens` and
`DEFAULT_NONE_HASH_SEED` out of `vllm/v1/core/kv_cache_utils.py` by source (that module imports all of vLLM),
so the functions that run are vLLM's, unchanged. `CASES` are the inputs; the output is one list of block
hashes (hex) per case. `tests/events/test_vllm_hashes.py` compares them with pagedkv's `hash_fn="vllm"`.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from pathlib import Path

# (name, NONE_HASH seed or None for the default, cache_salt, token ids, block size)
CASES = [
    ("plain", None, None, list(range(1, 17)), 4),
    ("salted", None, "tenant-a", list(range(1, 9)), 4),
    ("wide ids", None, None, [0, 23, 24, 255, 256, 65535, 65536, 151643, 2**31 - 1, 7, 7, 7], 4),
    ("seed 0", "0", None, [5] * 32, 16),
]


def vllm_hashes(src: str) -> dict[str, list[str]]:
    spec = importlib.util.spec_from_file_location("vllm_hashing", Path(src, "vllm/utils/hashing.py"))
    assert spec is not None and spec.loader is not None, "vllm_reference: no vllm/utils/hashing.py"
    hashing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hashing)
    tree = ast.parse(Path(src, "vllm/v1/core/kv_cache_utils.py").read_text())
    wanted = [
        n for n in tree.body
        if (isinstance(n, ast.FunctionDef) and n.name == "hash_block_tokens")
        or (isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "DEFAULT_NONE_HASH_SEED" for t in n.targets))
    ]  # fmt: skip
    assert len(wanted) == 2, "vllm_reference: hash_block_tokens or DEFAULT_NONE_HASH_SEED moved"
    ns: dict[str, object] = {"BlockHash": bytes, "Any": object, "Callable": object, "Sequence": object}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "kv_cache_utils.py", "exec"), ns)  # noqa: S102
    out: dict[str, list[str]] = {}
    for name, seed, salt, tokens, bs in CASES:
        ns["NONE_HASH"] = hashing.sha256_cbor(seed if seed is not None else ns["DEFAULT_NONE_HASH_SEED"])
        parent = None
        hashes = []
        for i in range(len(tokens) // bs):
            extra = (("cache_salt", salt),) if salt and i == 0 else None
            parent = ns["hash_block_tokens"](
                hashing.sha256_cbor, parent, tokens[i * bs : (i + 1) * bs], extra
            )
            hashes.append(parent.hex())
        out[name] = hashes
    return out


if __name__ == "__main__":
    print(json.dumps(vllm_hashes(os.environ["VLLM_SRC"])))
