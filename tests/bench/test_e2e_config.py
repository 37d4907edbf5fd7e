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


def test_repeats_report_the_median_run_and_paired_ratios() -> None:
    from pagedkv.bench.e2e import median_run, paired_ratios

    runs = {
        "pagedkv-paged": [{"tokens_per_s": 12.0, "wall_s": 1.0}, {"tokens_per_s": 10.0, "wall_s": 1.2},
                          {"tokens_per_s": 11.0, "wall_s": 1.1}],
        "hf-continuous-batching": [{"tokens_per_s": 10.0, "wall_s": 1.2}, {"tokens_per_s": 10.0, "wall_s": 1.2},
                                   {"tokens_per_s": 5.0, "wall_s": 2.4}],
    }  # fmt: skip
    median = median_run(runs["pagedkv-paged"])
    assert median["tokens_per_s"] == 11.0 and median["wall_s"] == 1.1
    assert median["runs_tokens_per_s"] == [12.0, 10.0, 11.0]
    ratios = paired_ratios(runs, "tokens_per_s")["pagedkv-paged/hf-continuous-batching"]
    assert ratios["runs"] == [1.2, 1.0, 2.2]  # run i against run i, not best against worst
    assert (ratios["median"], ratios["min"], ratios["max"]) == (1.2, 1.0, 2.2)
    assert median_run(runs["hf-continuous-batching"][:2])["tokens_per_s"] == 10.0
    assert paired_ratios({"hf-static": runs["pagedkv-paged"]}, "tokens_per_s") == {}


@pytest.mark.parametrize(
    "argv", [["--repeat", "0"], ["--trace-offset", "-1"], ["--num-requests", "0"], ["--systems", "nope"]]
)
def test_bad_arguments_are_one_line_before_any_model_loads(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    import pagedkv.hf.loading as loading

    def refuse(*_: object) -> None:
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model", refuse)
    from pagedkv.cli import main

    assert main(["bench", "e2e", *argv]) == 2  # the parser's checks and run's, one line either way
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagedkv bench e2e: error:")


def test_another_slice_of_the_trace() -> None:
    from pagedkv.bench.e2e import build_workload

    first = build_workload(8, 16, 2, 1000)
    later = build_workload(4, 16, 2, 1000, offset=4)
    assert [r.request_id for r in later] == [r.request_id for r in first[4:]]
    assert [r.output_len for r in later] == [r.output_len for r in first[4:]]


def test_growth_reserve_is_the_engine_default_and_reported_per_system() -> None:
    from pagedkv.engine.scheduler import SchedulerConfig

    args = parse([])
    args.host_blocks = 0
    assert args.admission_lookahead == SchedulerConfig().admission_lookahead == 16
    assert pagedkv_config("pagedkv-paged", args)["growth_reserve_tokens"] == 16
    assert "none" in str(pagedkv_config("pagedkv-contiguous", args)["growth_reserve_tokens"])
    assert "none" in hf_continuous_config(args)["growth_reserve_tokens"]
    assert pagedkv_config("pagedkv-paged", parse(["--admission-lookahead", "0"]))["growth_reserve_tokens"] == 0
