"""Console output: a progress bar (or, when output goes to a file, progress lines) carrying the key
numbers of the latest step."""

from __future__ import annotations

import datetime
import math
import time
from typing import Any, Callable

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = RichConsole(stderr=True)


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


_LABELS = {"reward/mean": "reward", "completion/length_mean": "len", "clip/high_frac": "clip+",
           "eval/accuracy": "eval_acc", "eval/loss": "eval_loss", "eval/format_compliance": "format",
           "grad_norm": "gnorm", "rewards/accuracy": "acc", "eval/rewards/accuracy": "eval_acc"}


def _label(key: str) -> str:
    return _LABELS.get(key, key.split("/")[-1])


class ProgressDisplay:
    """The progress of a run: a live bar with the latest step's key numbers and an ETA on a
    terminal; elsewhere (output piped to a file: nohup, CI, SLURM, `| tee`), where a live bar shows
    nothing until the end, plain lines: the first and last step, and one every `interval_s`."""

    def __init__(self, total: int, start: int, keys: list[str], enabled: bool, title: str,
                 interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.keys, self.total, self.title = keys, total, title
        self.enabled = enabled
        self._progress = None
        self._lines = enabled and not console.is_terminal
        self._clock, self.interval_s = clock, interval_s
        self._since = (start, clock())  # (step, time) the rate is measured from
        self._last_line: float | None = None
        if enabled and not self._lines:
            self._progress = Progress(
                TextColumn(f"[bold]{title}"), BarColumn(bar_width=16), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"), console=console,
                transient=False)
            self._task = self._progress.add_task("", total=total, completed=start)
            self._progress.start()

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        text = " ".join(f"{_label(k)}={fmt(metrics[k])}" for k in self.keys if k in metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=text)
        if not self._lines:
            return
        now = self._clock()
        if not metrics:  # a position without a step (a resumed run): the rate is measured from here
            self._since = (step, now)
            return
        due = self._last_line is None or now - self._last_line >= self.interval_s or step >= self.total
        if due:
            self._last_line = now
            console.print(progress_line(self.title, step, self.total, text, now - self._since[1],
                                        step - self._since[0]), highlight=False, soft_wrap=True)

    def print(self, *args: Any) -> None:
        if self._progress is not None:
            self._progress.console.print(*args)
        else:  # into a log file: one line per message, however long
            console.print(*args, soft_wrap=not console.is_terminal)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def progress_line(title: str, step: int, total: int, metrics: str, elapsed: float, steps_done: int) -> str:
    """'grpo step 12/40 (30%) reward=0.41 kl=0.002 | 0:01:00 elapsed, ETA 0:02:20'; the ETA
    assumes the remaining steps take as long as the ones since the run (or its resume) started."""
    eta = f"ETA {_clock_text(elapsed / steps_done * (total - step))}" if steps_done > 0 else "ETA ?"
    share = f" ({step / total:.0%})" if total else ""
    return (f"{title} step {step}/{total}{share}" + (f" {metrics}" if metrics else "")
            + f" | {_clock_text(elapsed)} elapsed, {eta}")


def _clock_text(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))
