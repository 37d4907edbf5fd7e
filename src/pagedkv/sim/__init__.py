"""The serving simulator: the real scheduler and allocators, with a GPU step-time model for the forward pass.

Entry points: `run_simulation(...)` (a comparison across allocators, returning a `SimulationReport`),
`simulate_main(argv)` / `plan_main(argv)` (the CLI commands as functions), `plan_capacity(...)`.
Never imports torch; matplotlib only when plotting.
"""

from __future__ import annotations

from typing import Any

__all__ = ["plan_main", "run_simulation", "simulate_main"]


def run_simulation(*args: Any, **kwargs: Any) -> Any:
    """See `pagedkv.sim.run.run_simulation`."""
    from pagedkv.sim.run import run_simulation as impl

    return impl(*args, **kwargs)


def simulate_main(argv: list[str] | None = None) -> int:
    """`pagedkv simulate` with `argv`; returns the exit status."""
    from pagedkv.sim.commands_simulate import simulate_main as impl

    return impl(argv)


def plan_main(argv: list[str] | None = None) -> int:
    """`pagedkv plan` with `argv`; returns the exit status."""
    from pagedkv.sim.commands_plan import plan_main as impl

    return impl(argv)
