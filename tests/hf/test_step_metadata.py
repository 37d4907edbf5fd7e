"""Packing a step: positions, cu_seqlens, seq_lens and logits rows follow the chunk layout."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.hf.step_metadata import build_step_batch


def test_packs_decode_and_prefill_chunks() -> None:
    # seq 0 decodes its 8th token; seq 1 prefills tokens 4..6 of a longer prompt (not its last: no logits)
    table = np.array([[1, 2, 0], [3, 4, 5]], dtype=np.int32)
    slots = np.array([2 * 4 + 3, 4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2], dtype=np.int64)
    batch = build_step_batch([[9], [5, 6, 7]], [7, 4], table, slots, [True, False])
    assert batch.input_ids.tolist() == [[9, 5, 6, 7]]
    assert batch.position_ids.tolist() == [[7, 4, 5, 6]]
    assert batch.cu_seqlens_q.tolist() == [0, 1, 4]
    assert batch.seq_lens.tolist() == [8, 7]
    assert batch.logits_indices.tolist() == [0]
    assert (batch.max_seqlen_q, batch.max_seqlen_k) == (3, 8)
    assert batch.slot_mapping.tolist() == slots.tolist()


def test_rejects_inconsistent_inputs() -> None:
    table = np.array([[1]], dtype=np.int32)
    with pytest.raises(InvalidArgumentError, match="one slot per new token"):
        build_step_batch([[1, 2]], [0], table, np.array([4], dtype=np.int64), [True])
    with pytest.raises(InvalidArgumentError, match="empty batch"):
        build_step_batch([], [], np.zeros((0, 1), np.int32), np.zeros(0, np.int64), [])


def test_cpu_groups_keep_decodes_together_and_prefill_chunks_alone() -> None:
    table = np.ones((4, 2), dtype=np.int32)
    tokens = [[1], [2], [3, 4, 5], [6]]
    slots = np.arange(6, dtype=np.int64)
    batch = build_step_batch(tokens, [4, 6, 0, 2], table, slots, [True] * 4)
    spans = [(g.token_start, g.token_end, g.cu_seqlens_q.tolist(), g.max_seqlen_q) for g in batch.groups]
    assert spans == [(0, 2, [0, 1, 2], 1), (2, 5, [0, 3], 3), (5, 6, [0, 1], 1)]
    assert [g.seq_lens.tolist() for g in batch.groups] == [[5, 7], [3], [3]]
    whole = build_step_batch(tokens, [4, 6, 0, 2], table, slots, [True] * 4, split_groups=False)
    assert len(whole.groups) == 1 and whole.groups[0].max_seqlen_q == 3
