"""`pagedkv bench e2e`'s fairness settings: equal headroom, the swap pool inside the budget, the config keys."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.bench.e2e import SYSTEMS, add_arguments, hf_continuous_config, pagedkv_config


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.max_new_tokens = args.max_new_tokens or 500
    return args


def test_recompute_by_default_and_no_host_pool() -> None:
    args = parse([])
    args.host_blocks = 0
    cfg = pagedkv_config("pagedkv-paged", args)
    assert cfg["preemption_mode"] == "recompute" and cfg["host_blocks"] == 0 and cfg["num_blocks"] == 96
    assert cfg["admission_headroom"] == 0.0


def test_one_headroom_for_both_systems() -> None:
    args = parse(["--admission-headroom", "0.15"])
    args.host_blocks = 0
    assert pagedkv_config("pagedkv-paged", args)["admission_headroom"] == 0.15
    assert hf_continuous_config(args)["safety_margin"] == 0.15


def test_swap_pool_is_taken_out_of_the_budget() -> None:
    args = parse(["--preemption", "swap", "--host-blocks", "24"])
    cfg = pagedkv_config("pagedkv-paged", args)
    assert cfg["num_blocks"] + cfg["host_blocks"] == 96 and cfg["host_blocks"] == 24
    contiguous = pagedkv_config("pagedkv-contiguous", args)
    assert contiguous["preemption_mode"] == "recompute" and contiguous["num_blocks"] == 96


def test_oracle_declares_the_true_length() -> None:
    args = parse([])
    args.host_blocks = 0
    assert "pagedkv-contiguous-oracle" in SYSTEMS
    assert pagedkv_config("pagedkv-contiguous-oracle", args)["declared_max_new_tokens"] == "true length"
    assert pagedkv_config("pagedkv-contiguous", args)["declared_max_new_tokens"] == 500


def test_transformers_gets_the_same_headroom_and_its_own_page_size_keyword() -> None:
    pytest.importorskip("transformers")
    import dataclasses

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = hf_continuous_config(parse([]))
    assert cfg["safety_margin"] == 0.0 and cfg["num_blocks"] == 96
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    key = "page_size" if "page_size" in names else "block_size"
    assert cfg[key] == 16
    built = ContinuousBatchingConfig(**{k: v for k, v in cfg.items() if k in names})
    assert built.safety_margin == 0.0 and built.num_blocks == 96
