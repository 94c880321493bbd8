"""Makes the site's figures under docs/assets/, as hand-written SVG (no plotting dependency: plotly needs
kaleido, a browser, to write static images):

- `pipeline.svg`: the pipeline every method runs (docs/architecture.md's picture, drawn);
- `demo-curves.svg`: the CPU demo's SFT loss, GRPO training reward and held-out accuracy, from the run
  directories and results.json that `rlft demo` writes.

    .venv/bin/python docs/figures.py                  # pipeline.svg, and demo-curves.svg if demo-output/ exists
    .venv/bin/python docs/figures.py --demo DIR       # the curves from `rlft demo --out DIR`
    .venv/bin/rlft demo && .venv/bin/python docs/figures.py   # both from a fresh demo (about 5 min on 2 cores)

The output is deterministic (no dates, fixed number formats), so tests/test_docs.py can check that the
committed pipeline.svg is what this script writes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from xml.sax.saxutils import escape

ASSETS = Path(__file__).resolve().parent / "assets"
FONT = "-apple-system, BlinkMacSystemFont, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"  # system fonts only
INK, MUTED, LINE = "#1f2937", "#6b7280", "#9ca3af"
ONLINE, OFFLINE, ACCENT = "#3f51b5", "#00897b", "#e65100"  # Material's indigo (the site's), teal, orange


def _svg(width: int, height: int, title: str, desc: str, body: list[str]) -> str:
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" font-family="{escape(FONT)}" font-size="14" fill="{INK}">',
        f"<title>{escape(title)}</title>", f"<desc>{escape(desc)}</desc>",
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="{LINE}"/></marker></defs>',
        f'<rect width="{width}" height="{height}" rx="8" fill="#ffffff"/>',
        *body, "</svg>", ""])


def _box(x: float, y: float, w: float, h: float, name: str, where: str, color: str) -> list[str]:
    return [f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="6" fill="{color}" fill-opacity="0.08" '
            f'stroke="{color}" stroke-width="1.5"/>',
            f'<text x="{x + w / 2}" y="{y + h / 2 - 3}" text-anchor="middle" font-weight="600">{escape(name)}</text>',
            f'<text x="{x + w / 2}" y="{y + h / 2 + 15}" text-anchor="middle" font-size="12" fill="{MUTED}" '
            f'font-family="ui-monospace, SFMono-Regular, Menlo, Consolas, monospace">{escape(where)}</text>']


def _arrow(x1: float, y1: float, x2: float, y2: float) -> str:
    return (f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{LINE}" stroke-width="1.5" '
            'marker-end="url(#arrow)"/>')


def pipeline_svg() -> str:
    """Online: prompts -> rollout engine -> completions -> rewards -> advantages -> policy update, the
    updated weights going back to the engine; offline methods read batches from data into a loss."""
    w, h, gap, top = 136, 56, 24, 56
    online = [("prompts", "data/"), ("rollout engine", "rollout/, agent/"), ("completions", "Completion"),
              ("rewards", "rewards/"), ("advantages", "algorithms/"), ("policy update", "training/online/")]
    x0 = 24
    body = [f'<text x="{x0}" y="34" font-weight="700" fill="{ONLINE}">Online RL</text>',
            f'<text x="{x0 + 92}" y="34" font-size="13" fill="{MUTED}">GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++, PPO, '
            "GSPO, CISPO, distillation</text>"]
    for i, (name, where) in enumerate(online):
        x = x0 + i * (w + gap)
        body += _box(x, top, w, h, name, where, ONLINE)
        if i:
            body.append(_arrow(x - gap, top + h / 2, x - 2, top + h / 2))
    # the loop closes: updated weights go to the engine for the next step's samples
    engine_mid, update_mid = x0 + (w + gap) + w / 2, x0 + 5 * (w + gap) + w / 2
    y_back = top + h + 26
    body += [f'<path d="M {update_mid} {top + h} V {y_back} H {engine_mid} V {top + h + 3}" fill="none" '
             f'stroke="{LINE}" stroke-width="1.5" marker-end="url(#arrow)"/>',
             f'<text x="{(engine_mid + update_mid) / 2}" y="{y_back + 16}" text-anchor="middle" font-size="12" '
             f'fill="{MUTED}">new weights, next step</text>']
    top2 = 222
    offline = [("batches", "data/"), ("loss: SFT, DPO or reward model", "sft.py, dpo.py, reward_model.py"),
               ("update", "training/offline/loop.py")]
    widths = [w, 2 * w + gap, w + 72]
    body += [f'<text x="{x0}" y="{top2 - 22}" font-weight="700" fill="{OFFLINE}">Offline</text>',
             f'<text x="{x0 + 66}" y="{top2 - 22}" font-size="13" fill="{MUTED}">no rollouts, no rewards: '
             "the batches come from the data</text>"]
    x = x0
    for i, ((name, where), bw) in enumerate(zip(offline, widths)):
        if i:
            body.append(_arrow(x - gap, top2 + h / 2, x - 2, top2 + h / 2))
        body += _box(x, top2, bw, h, name, where, OFFLINE)
        x += bw + gap
    width = x0 + 6 * w + 5 * gap + 24
    return _svg(width, top2 + h + 24, "The rlft pipeline",
                "Online methods sample completions of prompts with the rollout engine, score them with rewards, turn "
                "the scores into advantages and update the policy, whose new weights the engine samples from next. "
                "Offline methods (SFT, DPO, reward models) train on batches read from data.", body)


# -- the demo's curves -------------------------------------------------------------------------------

def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    """Round values (multiples of 1, 2 or 5 times a power of ten) in [lo, hi], about n + 1 of them."""
    raw = (hi - lo) / n or 1.0
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [k * step for k in range(first, math.floor(hi / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.2g}"


def _panel(x: float, y: float, w: float, h: float, title: str, series: list[tuple[list[float], list[float], str]],
           x_label: str, y_range: tuple[float, float], log_y: bool = False) -> list[str]:
    """A line chart: axes, ticks, a title and one polyline per (xs, ys, color)."""
    lo, hi = y_range
    if log_y:  # whole decades, so the ticks are 0.01, 0.1, 1 ...
        lo, hi = 10.0 ** math.floor(math.log10(lo)), 10.0 ** math.ceil(math.log10(hi))
    xs_all = [v for xs, _, _ in series for v in xs]
    x_lo, x_hi = min(xs_all), max(xs_all)

    def px(v: float) -> float:
        return x + (v - x_lo) / ((x_hi - x_lo) or 1) * w

    def py(v: float) -> float:
        if log_y:
            v, a, b = math.log10(max(v, lo)), math.log10(lo), math.log10(hi)
        else:
            a, b = lo, hi
        return y + h - (min(max(v, a), b) - a) / ((b - a) or 1) * h

    out = [f'<text x="{x}" y="{y - 12}" font-weight="600">{escape(title)}</text>',
           f'<line x1="{x}" y1="{y + h}" x2="{x + w}" y2="{y + h}" stroke="{LINE}"/>',
           f'<line x1="{x}" y1="{y}" x2="{x}" y2="{y + h}" stroke="{LINE}"/>']
    ticks = [10.0 ** k for k in range(round(math.log10(lo)), round(math.log10(hi)) + 1)] if log_y \
        else _ticks(lo, hi)
    for t in ticks:
        out += [f'<line x1="{x}" y1="{py(t):.1f}" x2="{x + w}" y2="{py(t):.1f}" stroke="#e5e7eb"/>',
                f'<text x="{x - 6}" y="{py(t) + 4:.1f}" text-anchor="end" font-size="11" fill="{MUTED}">'
                f"{_fmt(t)}</text>"]
    for t in _ticks(x_lo, x_hi):
        out.append(f'<text x="{px(t):.1f}" y="{y + h + 16}" text-anchor="middle" font-size="11" fill="{MUTED}">'
                   f"{t:.0f}</text>")
    out.append(f'<text x="{x + w / 2}" y="{y + h + 34}" text-anchor="middle" font-size="12" fill="{MUTED}">'
               f"{escape(x_label)}</text>")
    for xs, ys, color in series:
        points = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in zip(xs, ys))
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.8" '
                   'stroke-linejoin="round"/>')
    return out


def _moving_mean(values: list[float], k: int) -> list[float]:
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def demo_curves_svg(demo: Path) -> str:
    """Three panels from a demo's output folder: SFT loss, GRPO's share of correct training answers, and
    held-out accuracy before SFT, after SFT and after GRPO."""
    sft = [r for r in _read_jsonl(demo / "runs" / "sft" / "metrics.jsonl") if "loss" in r]
    grpo = [r for r in _read_jsonl(demo / "runs" / "grpo" / "metrics.jsonl") if "reward/correct" in r]
    results = json.loads((demo / "results.json").read_text())
    pw, ph, top, left = 250, 170, 48, 56
    body = _panel(left, top, pw, ph, "SFT loss (log scale)",
                  [([r["step"] for r in sft], [r["loss"] for r in sft], OFFLINE)], "optimizer step",
                  (min(r["loss"] for r in sft) * 0.8, max(r["loss"] for r in sft) * 1.2), log_y=True)
    correct = [r["reward/correct"] for r in grpo]
    steps = [r["step"] for r in grpo]
    body += _panel(left + pw + 70, top, pw, ph, "GRPO: training answers correct",
                   [(steps, correct, "#c5cae9"), (steps, _moving_mean(correct, 5), ONLINE)], "rollout step", (0.0, 1.0))
    # held-out accuracy: bars for the three models
    bx, labels = left + 2 * (pw + 70), [("base", "base"), ("SFT", "sft"), ("+ GRPO", "rl")]
    body += [f'<text x="{bx}" y="{top - 12}" font-weight="600">Held-out accuracy ({results["heldout_size"]} '
             "problems)</text>",
             f'<line x1="{bx}" y1="{top + ph}" x2="{bx + pw}" y2="{top + ph}" stroke="{LINE}"/>']
    for i, (label, key) in enumerate(labels):
        acc = results[key]["heldout/accuracy"]
        bar_w, x = 56, bx + 24 + i * 80
        bar_h = acc * (ph - 24)  # room above the tallest bar for its label
        color = [LINE, OFFLINE, ONLINE][i]
        body += [f'<rect x="{x}" y="{top + ph - bar_h:.1f}" width="{bar_w}" height="{bar_h:.1f}" fill="{color}"/>',
                 f'<text x="{x + bar_w / 2}" y="{top + ph - bar_h - 6:.1f}" text-anchor="middle" font-size="12">'
                 f"{acc:.2f}</text>",
                 f'<text x="{x + bar_w / 2}" y="{top + ph + 16}" text-anchor="middle" font-size="12" '
                 f'fill="{MUTED}">{escape(label)}</text>']
    seed = results.get("seed", 0)
    return _svg(int(bx + pw + 24), top + ph + 52, f"The CPU demo (rlft demo --seed {seed})",
                "SFT on sloppy worked solutions learns the answer format, then GRPO with a verifiable reward raises "
                "the share of correct answers; held-out accuracy of the random base model, the SFT model and the "
                "GRPO model.", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", type=Path, default=Path("demo-output"), help="what `rlft demo --out DIR` wrote")
    parser.add_argument("--out", type=Path, default=ASSETS, help="folder for the SVG files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.svg").write_text(pipeline_svg())
    print(f"wrote {args.out / 'pipeline.svg'}")
    if (args.demo / "results.json").is_file():
        (args.out / "demo-curves.svg").write_text(demo_curves_svg(args.demo))
        print(f"wrote {args.out / 'demo-curves.svg'} from {args.demo}")
    else:
        print(f"no demo run in {args.demo}: `rlft demo` makes one (about 5 min on 2 cores); demo-curves.svg kept")


if __name__ == "__main__":
    main()
