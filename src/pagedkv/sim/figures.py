"""The steps every pagedkv figure shares: a headless pyplot, one panel's labels, and writing the PNG.

Imported lazily by the plotting functions (matplotlib is the optional `plot` extra), so commands that draw
nothing never load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """`matplotlib.pyplot` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out `fig`, write it as a PNG at `path` (creating its folder), close it; returns the path."""
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def label_panel(ax: Any, title: str, ylabel: str, legend_loc: str = "upper right") -> None:
    """One panel's title (small, left), y label and legend, as every pagedkv figure draws them."""
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, loc=legend_loc)
