"""Console output: a progress bar carrying the key numbers of the latest step."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = RichConsole(stderr=True)


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


class ProgressDisplay:
    def __init__(self, total: int, start: int, keys: list[str], enabled: bool, title: str):
        self.keys = keys
        self.enabled = enabled
        self._progress = None
        if enabled:
            self._progress = Progress(
                TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("<"), TimeRemainingColumn(), TextColumn("{task.description}"), console=console,
                transient=False)
            self._task = self._progress.add_task("", total=total, completed=start)
            self._progress.start()

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if self._progress is None:
            return
        text = "  ".join(f"{k.split('/')[-1] if k.count('/') == 1 else k}={fmt(metrics[k])}"
                         for k in self.keys if k in metrics)
        self._progress.update(self._task, completed=step, description=text)

    def print(self, *args: Any) -> None:
        if self._progress is not None:
            self._progress.console.print(*args)
        else:
            console.print(*args)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
