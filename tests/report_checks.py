"""Reading a report page back: the series each plot draws, compared with what the runs logged.

Independent of rlft.monitor's own readers: metrics.jsonl is parsed here with `json`, and the
plots' data is read out of the page's `Plotly.newPlot(...)` calls."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

_PLOT = re.compile(r"data-metric='([^']*)'>.*?Plotly\.newPlot\(\s*\"[^\"]+\",\s*", re.S)


def plotted_series(html: str) -> dict[str, dict[str, tuple[list, list]]]:
    """{metric: {run name: (steps, values)}} for every plot in a report page."""
    decoder = json.JSONDecoder()
    out: dict[str, dict[str, tuple[list, list]]] = {}
    for match in _PLOT.finditer(html):
        traces, _ = decoder.raw_decode(html, match.end())
        out[match.group(1)] = {t["name"]: (t["x"], t["y"]) for t in traces}
    return out


def logged_series(run_dir: Path) -> dict[str, tuple[list, list]]:
    """{metric: (steps, values)} of a run's metrics.jsonl: the finite numbers (not bools) of each key."""
    series: dict[str, tuple[list, list]] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                steps, values = series.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(value)
    return series


def assert_report_shows_runs(report: Path, run_dirs: list[Path]) -> dict[str, dict[str, tuple[list, list]]]:
    """Every series each run logged has its plot, drawing exactly the logged (step, value) points
    under the run's name, and the page plots nothing else. Returns the plotted series."""
    plotted = plotted_series(Path(report).read_text())
    logged = {Path(d).name: logged_series(d) for d in run_dirs}
    expected = {key for series in logged.values() for key in series}
    assert expected and set(plotted) == expected, (expected ^ set(plotted))
    for name, series in logged.items():
        for key, (steps, values) in series.items():
            assert name in plotted[key], (key, name)
            assert plotted[key][name][0] == steps and plotted[key][name][1] == values, key
    return plotted


_SEGMENT = re.compile(r"<div class='seg (trained|inserted)'><div class='label'>(.*?) &middot; [^<]*</div>"
                      r"<pre>(.*?)</pre></div>", re.S)


def shown_segments(html_page: str) -> list[dict]:
    """The episode segments a report page shows, in page order, as samples.jsonl records them:
    {"role", "text", "trained"} (the trained flag read from the segment's styling class)."""
    from html import unescape

    return [{"role": unescape(role), "text": unescape(text), "trained": cls == "trained"}
            for cls, role, text in _SEGMENT.findall(html_page)]
