from __future__ import annotations

import math

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.sim.catalog import Catalog
from pagedkv.sim.guidance import GuidanceCell, _cell_config, guidance_sweep, plot_guidance, threshold_column
from pagedkv.sim.simulator import SimConfig


@pytest.fixture(scope="module")
def base() -> SimConfig:
    cat = Catalog.builtin()
    return SimConfig(model=cat.model("llama-2-7b"), gpu=cat.gpu("a100-40gb"))


def test_budget_is_the_requested_number_of_requests(base: SimConfig) -> None:
    config = _cell_config(base, 8, 640)
    assert config.budget().num_tokens == 8 * 640, "8 requests of 640 tokens, in whole blocks"
    assert config.max_model_len == 4096, "the model's context when the budget is larger"
    small = _cell_config(base, 2, 640)
    assert small.max_model_len == small.budget().num_tokens == 1280, "capped by the cache"
    with pytest.raises(InvalidArgumentError, match="cannot hold 1000 requests"):
        _cell_config(base, 1000, 640)


def test_sweep_cells_and_chart(base: SimConfig, tmp_path) -> None:
    cells = guidance_sweep(
        base, prompt_len=64, output_len=32, sigmas=(0.0, 1.5), pressures=(2, 16), num_requests=48
    )
    assert [(c.sigma, c.pressure) for c in cells] == [(0.0, 2), (0.0, 16), (1.5, 2), (1.5, 16)], "row-major"
    by = {(c.sigma, c.pressure): c for c in cells}
    fixed = by[(0.0, 16)]
    assert fixed.gain_vs_oracle == pytest.approx(1.0, abs=0.05), (
        "fixed lengths: the oracle is as good as paging"
    )
    assert by[(1.5, 16)].gain_vs_max > 1.3, "heavy tails under max reservation: paging wins"
    assert 14 <= fixed.paged_batch <= 16 * 96 / 80, "paged holds the pressure, more while outputs are young"
    path = plot_guidance(cells, tmp_path / "g.png", "test")
    assert path.stat().st_size > 10_000, "a PNG was written"


def test_threshold_column_interpolates_in_log2() -> None:
    def cell(p: int, batch: float) -> GuidanceCell:
        r = {"paged": {"mean_concurrency": batch, "requests_per_s": 1.0}}
        return GuidanceCell(0.0, p, 4096, 10, r)

    cells = [cell(4, 4.0), cell(8, 6.0), cell(16, 10.0)]
    assert threshold_column(cells) == pytest.approx(2 ** (3 + 0.5)), "halfway from 6 to 10 between 8 and 16"
    assert threshold_column([cell(4, 9.0), cell(8, 12.0)]) == 4, "every column above: the first"
    assert math.isclose(threshold_column([cell(4, 1.0)]), 4), "none reaches 8: the last"
