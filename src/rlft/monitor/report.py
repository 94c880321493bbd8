"""`rlft report`: one self-contained HTML file for one or more run directories.

Every numeric series of metrics.jsonl gets a plot (plotly, whose JavaScript is inlined once, so the
file opens with no network), grouped by subject; several runs are overlaid, one colour per run;
detector events (events.jsonl) are marked on the curves of the metrics that triggered them; sample
completions at a few steps are shown with their rewards (a multi-turn episode whole, its trained
tokens set apart from inserted tool output); with several runs, a table lists the
config fields that differ. All text from the run (completions, prompts, config) is HTML-escaped.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Callable

import yaml

from rlft.errors import RlftError
from rlft.monitor.rundir import Redo, write_text_atomic, writing
from rlft.monitor.runlog import RunData, flatten, is_number, load_runs

# (section title, does a metric key belong here) in page order; a key goes to the first match
SECTIONS: list[tuple[str, Callable[[str], bool]]] = [
    ("Reward", lambda k: k.startswith("reward/") and k != "reward/infra_error_rate"),
    ("Held-out", lambda k: k.startswith("eval/")),
    ("KL and entropy", lambda k: k in ("kl", "entropy", "beta") or k.startswith(("kl/", "entropy/"))),
    ("Completions", lambda k: k.startswith("completion/")),
    ("Policy update: clipping, importance ratio, advantages",
     lambda k: k.startswith(("clip/", "ratio/", "rollout/", "adv/", "update/", "value/", "policy/"))),
    ("Training", lambda k: k in ("loss", "grad_norm", "lr", "epoch") or k.startswith(("loss/", "nll/"))),
    ("Preference and reward-model scores", lambda k: k.startswith(("rewards/", "rm/", "scores/", "logps/"))),
    ("Throughput", lambda k: k in ("tokens_per_s", "step_time") or k.startswith("time/")),
    ("Health", lambda k: k in ("reward/infra_error_rate", "nonfinite_skipped")),
    ("Other", lambda k: True),
]
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22"]
ACTION_COLOURS = {"warn": "#e69f00", "stop": "#cc0000"}
NOT_EXPERIMENT_SETTINGS = ("output_dir",)  # differs between any two runs; not a setting that was tried


def write_report(run_dirs: list[str | Path], out: str | Path, sample_steps: list[int] | None = None) -> Path:
    """Write the report of `run_dirs` to `out` (an .html file) and return its path. `sample_steps`
    chooses the steps whose saved completions are shown (default: first, middle and last)."""
    if not run_dirs:
        raise RlftError("rlft report: give at least one run directory")
    runs = load_runs(list(run_dirs))
    out = Path(out)
    redo = Redo("an --out file", "run `rlft report` again")
    with writing("creating the report's folder", out.parent, redo):
        out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, render_report(runs, sample_steps), "writing the report", redo)
    return out


def render_report(runs: list[RunData], sample_steps: list[int] | None = None) -> str:
    plotly_js = _plotly_js()
    title = "rlft report: " + ", ".join(r.name for r in runs)
    body = [f"<h1>{_e(title)}</h1>", _header(runs), _config_section(runs), _events_section(runs)]
    body += _plot_sections(runs)
    body.append(_samples_section(runs, sample_steps))
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>\n"
            f"<style>{CSS}</style>\n<script>{plotly_js}</script></head>\n<body>\n"
            + "\n".join(b for b in body if b) + "\n</body></html>\n")


def _plotly_js() -> str:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise RlftError("rlft report needs plotly (an rlft dependency): pip install 'plotly>=5'") from None
    return get_plotlyjs()


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {sec:02d}s" if hours else f"{minutes}m {sec:02d}s"


def _colour(i: int) -> str:
    return COLOURS[i % len(COLOURS)]


# ---------------------------------------------------------------------------------------------
# Header, config differences, events


def _header(runs: list[RunData]) -> str:
    rows = []
    for i, run in enumerate(runs):
        model = (run.config.get("model") or {}).get("path", "?")
        wall = run.wall_time_s()
        wall_text = _duration(wall) + ("" if is_number(run.summary.get("wall_time_s")) or wall is None
                                       else " (sum of step times)")
        rows.append(f"<tr><td><span class='swatch' style='background:{_colour(i)}'></span>{_e(run.name)}</td>"
                    f"<td>{_e(run.status)}</td><td>{_e(run.method)}</td><td class='path'>{_e(model)}</td>"
                    f"<td>{_e(_fmt(run.last_step))}</td><td>{_e(wall_text)}</td><td class='path'>{_e(run.path)}</td>"
                    "</tr>")
    return ("<table class='header'><tr><th>run</th><th>status</th><th>method</th><th>model</th><th>steps</th>"
            "<th>wall time</th><th>directory</th></tr>" + "".join(rows) + "</table>")


def config_differences(runs: list[RunData]) -> dict[str, list[Any]]:
    """Dotted config keys whose values are not the same in every run (output_dir left out)."""
    flat = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flat)) if flat else []
    diffs = {}
    for key in keys:
        if key in NOT_EXPERIMENT_SETTINGS:
            continue
        values = [f.get(key) for f in flat]
        if any(json.dumps(v, sort_keys=True, default=str) != json.dumps(values[0], sort_keys=True, default=str)
               for v in values[1:]):
            diffs[key] = values
    return diffs


def _config_section(runs: list[RunData]) -> str:
    if len(runs) == 1:
        text = yaml.safe_dump(runs[0].config, sort_keys=False)
        return f"<details><summary>config.yaml</summary><pre>{_e(text)}</pre></details>"
    diffs = config_differences(runs)
    if not diffs:
        return "<h2>Config</h2><p>The runs have the same config (besides output_dir).</p>"
    head = "".join(f"<th>{_e(r.name)}</th>" for r in runs)
    rows = "".join(f"<tr><td class='path'>{_e(k)}</td>" + "".join(f"<td>{_e(_fmt(v))}</td>" for v in values)
                   + "</tr>" for k, values in diffs.items())
    return f"<h2>Config fields that differ</h2><table class='diff'><tr><th>field</th>{head}</tr>{rows}</table>"


def _events_section(runs: list[RunData]) -> str:
    rows = []
    for run in runs:
        for ev in run.events:
            action = str(ev.get("action", "warn"))
            rows.append(f"<tr class='{_e(action)}'><td>{_e(run.name)}</td><td>{_e(ev.get('step'))}</td>"
                        f"<td>{_e(ev.get('detector'))}</td><td>{_e(action)}</td><td>{_e(ev.get('message'))}</td></tr>")
    if not rows:
        return "<h2>Health events</h2><p>No detector fired.</p>"
    return ("<h2>Health events</h2><table class='events'><tr><th>run</th><th>step</th><th>detector</th>"
            "<th>action</th><th>message</th></tr>" + "".join(rows) + "</table>")


# ---------------------------------------------------------------------------------------------
# Plots


def group_metrics(keys: list[str]) -> list[tuple[str, list[str]]]:
    """Metric keys by report section, in section order (sections without keys left out)."""
    groups: dict[str, list[str]] = {title: [] for title, _ in SECTIONS}
    for key in keys:
        title = next(t for t, belongs in SECTIONS if belongs(key))
        groups[title].append(key)
    return [(t, ks) for t, ks in groups.items() if ks]


def _plot_sections(runs: list[RunData]) -> list[str]:
    keys: dict[str, None] = {}
    for run in runs:
        keys.update(dict.fromkeys(run.numeric_keys()))
    out, n = [], 0
    for title, section_keys in group_metrics(list(keys)):
        plots = []
        for key in section_keys:
            plots.append(_plot(runs, key, f"plot-{n}"))
            n += 1
        out.append(f"<h2>{_e(title)}</h2><div class='grid'>{''.join(plots)}</div>")
    return out


AXIS = {"gridcolor": "#eaeaea", "zeroline": False, "linecolor": "#999", "showline": True, "automargin": True}
PLOT_CONFIG = {"displaylogo": False, "responsive": True,
               "modeBarButtonsToRemove": ["select2d", "lasso2d", "autoScale2d"]}


def _plot(runs: list[RunData], key: str, div_id: str) -> str:
    # The figure is a plain dict rendered without validation: plotly's Figure objects validate
    # every property and cost ~0.1 s per plot, which a report of 40+ plots would feel.
    import plotly.io as pio

    traces, shapes, notes = [], [], []
    for i, run in enumerate(runs):
        points = [(r["step"], r[key]) for r in run.metrics if is_number(r.get(key)) and is_number(r.get("step"))]
        if not points:
            continue
        traces.append({"type": "scatter", "x": [p[0] for p in points], "y": [p[1] for p in points],
                       "name": _e(run.name), "mode": "lines+markers" if len(points) <= 60 else "lines",
                       "line": {"color": _colour(i), "width": 1.5}, "marker": {"size": 4},
                       "showlegend": len(runs) > 1})
        for ev in run.events:
            if key in (ev.get("values") or {}) and is_number(ev.get("step")):
                colour = ACTION_COLOURS.get(ev.get("action"), ACTION_COLOURS["warn"])
                label = str(ev.get("detector", "event")) + (f" ({run.name})" if len(runs) > 1 else "")
                shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": ev["step"], "x1": ev["step"],
                               "y0": 0, "y1": 1, "line": {"color": colour, "dash": "dot", "width": 1.5}})
                notes.append({"xref": "x", "yref": "paper", "x": ev["step"], "y": 1, "xanchor": "left",
                              "yanchor": "top", "showarrow": False, "text": _e(label),
                              "hovertext": _e(ev.get("message", "")), "font": {"color": colour, "size": 10}})
    yaxis = dict(AXIS)
    ys = [v for t in traces for v in t["y"]]
    if ys and 0 < max(abs(v) for v in ys) < 1e-2:  # learning rates and the like: 1e-05, not 0
        yaxis.update(exponentformat="e", tickformat=".2~e")
    if ys and min(ys) == max(ys) != 0:  # a constant: centre it (plotly's default range is +-1 around it)
        yaxis["range"] = sorted([ys[0] * 0.5, ys[0] * 1.5])
    layout = {"title": {"text": _e(key), "font": {"size": 13}, "x": 0.02}, "height": 260,
              "margin": {"l": 50, "r": 15, "t": 35, "b": 35}, "plot_bgcolor": "white", "paper_bgcolor": "white",
              "xaxis": {**AXIS, "title": {"text": "step"}}, "yaxis": yaxis, "shapes": shapes, "annotations": notes,
              "legend": {"orientation": "h", "y": -0.3}, "hovermode": "x unified"}
    plot = pio.to_html({"data": traces, "layout": layout}, validate=False, full_html=False, include_plotlyjs=False,
                       div_id=div_id, config=PLOT_CONFIG)
    return f"<div class='plot' data-metric='{_e(key)}'>{plot}</div>"


# ---------------------------------------------------------------------------------------------
# Samples


def choose_sample_steps(steps: list[int], wanted: list[int] | None = None) -> list[int]:
    """The steps to show: those asked for that exist, else the first, middle and last."""
    steps = sorted(set(steps))
    if wanted:
        return [s for s in sorted(set(wanted)) if s in steps]
    if len(steps) <= 3:
        return steps
    return [steps[0], steps[len(steps) // 2], steps[-1]]


def _samples_section(runs: list[RunData], wanted: list[int] | None) -> str:
    """Step by step, every run's saved completions side by side."""
    by_run: list[dict[int, list[dict[str, Any]]]] = []
    for run in runs:
        by_step: dict[int, list[dict[str, Any]]] = {}
        for s in run.samples:
            if isinstance(s.get("step"), int):
                by_step.setdefault(s["step"], []).append(s)
        by_run.append(by_step)
    steps = choose_sample_steps([s for by_step in by_run for s in by_step], wanted)
    parts = []
    for step in steps:
        cards = "".join(_sample_card(s, run.name if len(runs) > 1 else None, _colour(i))
                        for i, (run, by_step) in enumerate(zip(runs, by_run)) for s in by_step.get(step, []))
        parts.append(f"<h3>step {step}</h3><div class='samples'>{cards}</div>")
    if not parts:
        return ""
    return "<h2>Sample completions</h2>" + "".join(parts)


def _sample_card(sample: dict[str, Any], run_name: str | None, colour: str) -> str:
    reward = sample.get("reward")
    reward_text = "unverifiable (None)" if reward is None else _fmt(reward)
    components = sample.get("components") or {}
    comps = ", ".join(f"{_e(k)}={_e(_fmt(v))}" for k, v in components.items())
    run = f"<span class='swatch' style='background:{colour}'></span>{_e(run_name)} &middot; " if run_name else ""
    return (f"<div class='sample' style='border-left: 3px solid {colour}'><div class='meta'>{run}"
            f"reward <b>{_e(reward_text)}</b>"
            + (f" ({comps})" if comps else "")
            + f" &middot; finish: {_e(sample.get('finish_reason', '?'))} &middot; {_e(sample.get('where', ''))}</div>"
            f"<div class='label'>prompt</div><pre>{_e(sample.get('prompt', ''))}</pre>"
            + _completion_html(sample) + "</div>")


def _completion_html(sample: dict[str, Any]) -> str:
    """A multi-turn sample's whole episode, segment by segment with its role, trained tokens (the
    loss mask's 1s) set apart from inserted ones; a single-turn sample's completion text."""
    segments = [s for s in sample.get("segments") or [] if isinstance(s, dict)]
    if not segments:
        return f"<div class='label'>completion</div><pre>{_e(sample.get('completion', ''))}</pre>"
    turns = f"turns {_e(sample.get('turns', '?'))} &middot; tool calls {_e(sample.get('tool_calls', '?'))}"
    parts = []
    for seg in segments:
        trained = seg.get("trained") is True
        label = f"{_e(seg.get('role', '?'))} &middot; {'trained' if trained else 'not trained (inserted)'}"
        parts.append(f"<div class='seg {'trained' if trained else 'inserted'}'><div class='label'>{label}</div>"
                     f"<pre>{_e(seg.get('text', ''))}</pre></div>")
    return f"<div class='label'>episode &middot; {turns}</div><div class='transcript'>{''.join(parts)}</div>"


CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.path { font-family: monospace; word-break: break-all; max-width: 36em; }
tr.stop td { background: #fde8e8; } tr.warn td { background: #fff6e0; }
.swatch { display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.4em; border-radius: 2px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 8px; }
.samples { display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: 8px; }
.sample { border: 1px solid #ddd; border-radius: 4px; padding: 6px 8px; font-size: 0.85em; }
.sample .label { color: #777; font-size: 0.8em; margin-top: 4px; }
.seg { border-left: 3px solid; padding-left: 4px; margin: 2px 0; }
.seg.trained { border-color: #2ca02c; } .seg.trained pre { background: #eef8ee; }
.seg.inserted { border-color: #bbb; } .seg.inserted pre { background: #f1f1f1; color: #666; font-style: italic; }
pre { white-space: pre-wrap; word-break: break-word; background: #f8f8f8; margin: 2px 0; padding: 4px;
      max-height: 18em; overflow: auto; }
details pre { max-height: 30em; }
"""
