"""Progress on stderr, only where a person watches it: on a terminal, and only for work past a second.

Piped or redirected output (a log, `make demo | tee`, a test) gets no bar at all, so no carriage-return line
grows to kilobytes there. A bar that would vanish within `delay_s` is never drawn; one that is drawn is
redrawn at most every `interval_s` and wiped by `close`. Torch-free and dependency-free, so every layer that
runs long work (the planner, the benchmarks, the first GGUF conversion) uses this one.

A command made of phases names each as it starts (`stage`); with `tick=True` a background thread redraws
the line every `interval_s`, so a phase that reports nothing for seconds (one long numpy pass, building a
workload) still shows what runs and for how long. `PAGEDKV_PROGRESS_DELAY_S` overrides the default delay
(tests set 0 to see the line at once).
"""

from __future__ import annotations

import os
import sys
import threading
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
    `stage(name)` starts a named phase (its own count and unit); `tick=True` redraws on its own.
    """

    def __init__(
        self, label: str, total: int | None = None, *, unit: str = "", enabled: bool | None = None,
        delay_s: float | None = None, interval_s: float = 0.1, stream: TextIO | None = None, tick: bool = False,
    ) -> None:  # fmt: skip
        self.stream = sys.stderr if stream is None else stream
        self.enabled = on_terminal(self.stream) if enabled is None else enabled
        self.label, self.total, self.unit = label, total, unit
        self.done = 0
        self.note = ""
        self.stage_name = ""
        self._start = time.monotonic()
        self._delay = _default_delay() if delay_s is None else delay_s
        self._interval = interval_s
        self._last = 0.0
        self._width = 0  # characters drawn on the line (0: nothing drawn yet)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if tick and self.enabled:
            self._ticker = threading.Thread(target=self._tick, name=f"progress: {label}", daemon=True)
            self._ticker.start()

    def stage(self, name: str, *, total: int | None = None, unit: str = "") -> None:
        """Start the phase `name`: its count starts at 0 (of `total`, in `unit`); drawn when due."""
        with self._lock:
            self.stage_name, self.total, self.unit, self.done, self.note = name, total, unit, 0, ""
        self._maybe_draw(force_interval=True)

    def update(self, n: int = 1, note: str | None = None) -> None:
        self.done += n
        if note is not None:
            self.note = note
        self._maybe_draw()

    def _maybe_draw(self, *, force_interval: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._start < self._delay or (not force_interval and now - self._last < self._interval):
            return
        self._last = now
        self._draw(now)

    def _tick(self) -> None:
        while not self._stop.wait(self._interval):
            if time.monotonic() - self._start >= self._delay:
                self._draw(time.monotonic())

    def _draw(self, now: float) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            elapsed = now - self._start
            unit = f" {self.unit}" if self.unit else ""
            head = f"{self.label}: {self.stage_name}" if self.stage_name else self.label
            if self.total:
                frac = min(self.done / self.total, 1.0)
                fill = int(frac * BAR_WIDTH)
                text = f"{head} [{'#' * fill}{'.' * (BAR_WIDTH - fill)}] {self.done:,}/{self.total:,}{unit}"
            elif self.stage_name:
                text = head + (f": {self.done:,}{unit}" if self.done else "")
            else:
                text = f"{head}: {self.done:,}{unit}"
            text += f" {self.note}" if self.note else ""
            text += f" ({elapsed:.0f} s)"
            pad = max(self._width - len(text), 0)
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._width = len(text)

    def close(self) -> None:
        """Stop the ticker and wipe the line (if anything was drawn)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        with self._lock:
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


def _default_delay() -> float:
    """One second, or `PAGEDKV_PROGRESS_DELAY_S` when set to a number >= 0."""
    try:
        return max(float(os.environ.get("PAGEDKV_PROGRESS_DELAY_S", "1.0")), 0.0)
    except ValueError:
        return 1.0
