from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.workloads.traces import (
    default_trace_path,
    generated_token_ids,
    load_trace,
    prompt_token_ids,
    sm64,
    synth_tokens,
)

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
MOONCAKE = SHARED / "mooncake-fast25" / "synthetic_trace.jsonl"


def test_splitmix64_reference_values() -> None:
    # splitmix64 with state 0: the first outputs of the reference generator
    assert int(sm64(0)) == 0xE220A8397B1DCDAF
    assert int(sm64(0x9E3779B97F4A7C15)) == 0x6E789E6AA1B965F4


def test_shipped_azure_trace_reads_with_relative_arrivals() -> None:
    reqs = load_trace(default_trace_path(), limit=5)
    assert [r.prompt_len for r in reqs[:2]] == [374, 396]
    assert [r.output_len for r in reqs[:2]] == [44, 109]
    assert reqs[0].arrival_s == 0.0 and 4.0 < reqs[1].arrival_s < 4.5
    assert all(r.hash_ids is None for r in reqs)


def test_azure_prompts_are_private_and_deterministic() -> None:
    a, b = load_trace(default_trace_path(), limit=2)
    pa, pb = prompt_token_ids(a), prompt_token_ids(b)
    assert len(pa) == 374 and pa.dtype == np.int32 and pa.max() < 50000
    assert not np.array_equal(pa[:16], pb[:16])
    assert np.array_equal(pa, prompt_token_ids(a))
    assert np.array_equal(generated_token_ids(a, 3, 5), synth_tokens(1, a.index, [3, 4]))


@pytest.mark.skipif(not MOONCAKE.exists(), reason="needs ../shared/data")
def test_mooncake_equal_hash_prefixes_give_equal_token_prefixes() -> None:
    reqs = load_trace(MOONCAKE, limit=50)
    pairs = [(x, y) for x in reqs for y in reqs if x.index < y.index and x.hash_ids[:2] == y.hash_ids[:2]]
    assert pairs, "the trace has shared prefixes"
    x, y = pairs[0]
    k = next(i for i, (p, q) in enumerate(zip(x.hash_ids, y.hash_ids)) if p != q) if x.hash_ids != y.hash_ids else len(x.hash_ids)
    tx, ty = prompt_token_ids(x), prompt_token_ids(y)
    n = min(k * 512, len(tx), len(ty))
    assert np.array_equal(tx[:n], ty[:n])
    assert len(tx) == x.prompt_len


def test_broken_rows_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.0,abc,3\n")
    with pytest.raises(InvalidArgumentError, match=r"t.csv:3: ContextTokens"):
        load_trace(bad)
    bad_json = tmp_path / "t.jsonl"
    bad_json.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(InvalidArgumentError, match=r"t.jsonl:2"):
        load_trace(bad_json)
    with pytest.raises(InvalidArgumentError, match="not found"):
        load_trace(tmp_path / "missing.csv")
    with pytest.raises(InvalidArgumentError, match="unknown trace format"):
        load_trace(bad.rename(tmp_path / "t.txt"))
