"""The tiers' index, policy and backends never import torch (only `pagedkv.storage.block_rows` and the
engine move bytes between them and device pages)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiers_and_engine_config_import_without_torch() -> None:
    code = (
        "import sys\n"
        "import pagedkv.tiers, pagedkv.tiers.store, pagedkv.tiers.disk, pagedkv.tiers.host, pagedkv.tiers.remote\n"
        "import pagedkv.tiers.redis_server, pagedkv.engine.config, pagedkv.engine.outputs, pagedkv.bench.tiers\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""}, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
