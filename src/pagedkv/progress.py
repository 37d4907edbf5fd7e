"""Progress on stderr, only where a person watches it: on a terminal, and only for work past a second.

Piped or redirected output (a log, `make demo | tee`, a test) gets no bar at all, so no carriage-return line
grows to kilobytes there. A bar that would vanish within `delay_s` is never drawn; one that is drawn is
redrawn at most every `interval_s` and wiped by `close`. Torch-free and dependency-free, so every layer that
runs long work (the planner, the benchmarks, the first GGUF conversion) uses this one.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

BAR_WIDTH = 24


def on_terminal(stream: TextIO | None = None) -> bool:
    """Whether `stream` (stderr by default) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real file
        return False


class Progress:
    """`with Progress("plan", total=n) as bar: ... bar.update(k)`. `total=None`: a counter without a bar.

    `enabled=None` means "on a terminal"; `False` silences it (`--no-progress`), `True` forces it (tests).
    """

    def __init__(
        self, label: str, total: int | None = None, *, unit: str = "", enabled: bool | None = None,
        delay_s: float = 1.0, interval_s: float = 0.1, stream: TextIO | None = None,
    ) -> None:  # fmt: skip
        self.stream = sys.stderr if stream is None else stream
        self.enabled = on_terminal(self.stream) if enabled is None else enabled
        self.label, self.total, self.unit = label, total, unit
        self.done = 0
        self.note = ""
        self._start = time.monotonic()
        self._delay, self._interval = delay_s, interval_s
        self._last = 0.0
        self._width = 0  # characters drawn on the line (0: nothing drawn yet)

    def update(self, n: int = 1, note: str | None = None) -> None:
        self.done += n
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._start < self._delay or now - self._last < self._interval:
            return
        self._last = now
        self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = now - self._start
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            frac = min(self.done / self.total, 1.0)
            fill = int(frac * BAR_WIDTH)
            text = f"{self.label} [{'#' * fill}{'.' * (BAR_WIDTH - fill)}] {self.done:,}/{self.total:,}{unit}"
        else:
            text = f"{self.label}: {self.done:,}{unit}"
        text += f" {self.note}" if self.note else ""
        text += f" ({elapsed:.0f} s)"
        pad = max(self._width - len(text), 0)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._width = len(text)

    def close(self) -> None:
        """Wipe the line (if anything was drawn)."""
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
