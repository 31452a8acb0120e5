"""Progress as log lines, for runs whose stdout is not a terminal (``make fit > log``, nohup, SLURM, CI).

Progress bars (tqdm, Rich) redraw one line in place and only draw on a terminal: redirected to a
file they show nothing for minutes, or a wall of carriage returns. :class:`Ticker` writes plain
INFO lines on the ``exittrain`` logger instead, every ``every`` steps or every ``every_s`` seconds,
whichever comes first, e.g.::

    pretrain step 120/600 (20%) loss=2.345 rows_s=45.1 elapsed=0:01:02 eta=0:04:08

A ticker speaks only between the counted steps; one long call (a batch of generation, a drafter's
trees scored on every answer) is silent until it returns. :class:`Heartbeat` covers such a call: a
line every ``every_s`` seconds while it runs, from a helper thread.

:func:`interactive` tells whether a run should draw bars or log lines. Standard library only: the
Lightning callback built on the ticker lives in :mod:`exittrain.lit.progress_callbacks`.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Heartbeat", "Ticker", "format_duration", "interactive"]

log = logging.getLogger("exittrain")


def interactive(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: the current ``sys.stdout``) is a terminal.

    False for a redirected, closed or missing stdout (``sys.stdout`` may be None under pythonw or a
    daemon, a replaced stream may have no ``isatty``, a closed file raises on it).
    """
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` (whole seconds, rounded down); ``?`` for None or a non-finite or negative value."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _format_value(value: Any) -> str:
    # 4 significant digits reads well for losses and rates alike; large rates need no decimals
    if isinstance(value, float):
        return f"{value:.0f}" if math.isfinite(value) and abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


class Ticker:
    """Log ``<label> <unit> n/total (p%) key=value ... elapsed=H:MM:SS eta=H:MM:SS`` now and then.

    Args:
        label: what is progressing (a stage name, ``regenerate (target)``).
        total: the count at which the work is done; None when unknown (no percentage, no ETA).
        unit: the counted thing, printed between label and count (``step``, ``batch``; "" for none).
        every: log when ``n`` reaches a new multiple of ``every`` (0: no step interval).
        every_s: log when ``every_s`` seconds passed since the previous line (0: no time interval).
        start: the count already done when the ticker is made (a resumed run): the rate, and so
            the ETA, count only the work done since.
        clock: seconds, monotonic (injectable for tests); the ticker's time starts at construction.

    The first :meth:`update` always logs, and so does the one that reaches ``total``; a repeated
    ``n`` never logs twice. ETA = remaining / mean rate since construction, ``(n - start) / elapsed``.
    """

    def __init__(
        self,
        label: str,
        total: int | None = None,
        *,
        unit: str = "step",
        every: int = 50,
        every_s: float = 30.0,
        start: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (isinstance(every, int) and every >= 0):
            raise ValueError(f"every={every!r}: need an int >= 0 (0 = no step interval)")
        if not every_s >= 0:
            raise ValueError(f"every_s={every_s!r}: need a number of seconds >= 0 (0 = no time interval)")
        if total is not None and total < 0:
            raise ValueError(f"total={total!r}: need a count >= 0, or None when unknown")
        self.label = label
        self.total = total
        self.unit = unit
        self.every = every
        self.every_s = float(every_s)
        self.start = start
        self.n = start
        self._clock = clock
        self._t0 = clock()
        self._last_n: int | None = None  # count of the latest line, None before the first
        self._last_t = self._t0

    @property
    def elapsed(self) -> float:
        """Seconds since the ticker was made."""
        return self._clock() - self._t0

    def eta(self, n: int) -> float | None:
        """Seconds left at count ``n`` at the mean rate so far; None while unknown (no total, no progress yet)."""
        done, elapsed = n - self.start, self.elapsed
        if self.total is None or done <= 0 or elapsed <= 0:
            return None
        return max(self.total - n, 0) * elapsed / done

    def due(self, n: int) -> bool:
        """Whether :meth:`update` at count ``n`` would log (callers skip computing a costly postfix otherwise)."""
        if self._last_n is None:
            return True
        if n == self._last_n:
            return False
        if self.total is not None and n >= self.total:
            return True
        if self.every and n // self.every > self._last_n // self.every:
            return True
        return bool(self.every_s) and self._clock() - self._last_t >= self.every_s

    def line(self, n: int, **postfix: Any) -> str:
        """The text of the line at count ``n`` (nothing logged, no state changed)."""
        head = f"{self.label} {self.unit} " if self.unit else f"{self.label} "
        count = f"{n}/{self.total}" if self.total is not None else f"{n}"
        if self.total:
            count += f" ({100 * n // self.total}%)"
        fields = [f"{key}={_format_value(value)}" for key, value in postfix.items() if value is not None]
        fields += [f"elapsed={format_duration(self.elapsed)}", f"eta={format_duration(self.eta(n))}"]
        return head + count + " " + " ".join(fields)

    def update(self, n: int, **postfix: Any) -> str | None:
        """Record count ``n`` (the total done so far, not an increment) and log a line when :meth:`due`.

        ``postfix`` values are printed ``key=value`` in the given order (floats to 4 significant
        digits; None values are left out). Returns the logged text, or None when nothing was logged.
        """
        self.n = n
        if not self.due(n):
            return None
        text = self.line(n, **postfix)
        log.info("%s", text)
        self._last_n, self._last_t = n, self._clock()
        return text

    def advance(self, k: int = 1, **postfix: Any) -> str | None:
        """:meth:`update` at the current count plus ``k``."""
        return self.update(self.n + k, **postfix)


class Heartbeat:
    """A context manager that logs ``<label>: running, elapsed=H:MM:SS`` every ``every_s`` seconds while
    its block runs, so that one long call shows it is alive (nothing is logged for a block shorter
    than ``every_s``).

    The lines come from a daemon thread, which waits on an event and so costs nothing between them;
    it can speak while the block holds the interpreter only because torch's kernels release it, so a
    block of pure Python may delay a line. The thread is joined on exit, exception or not.
    ``every_s`` <= 0 turns the heartbeat off.
    """

    def __init__(self, label: str, every_s: float = 20.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.every_s, self._clock = label, float(every_s), clock
        self.beats = 0  # lines logged so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self, t0: float) -> None:
        while not self._stop.wait(self.every_s):
            self.beats += 1
            log.info("%s: running, elapsed=%s", self.label, format_duration(self._clock() - t0))

    def __enter__(self) -> Heartbeat:
        if self.every_s > 0:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, args=(self._clock(),), daemon=True,
                                            name=f"heartbeat {self.label}")
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
