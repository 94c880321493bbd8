"""Makes docs/report-example.png: a real 30-step GRPO run on the tiny test model, its metrics
replayed through the health monitor (events.jsonl), its report, and a Chromium screenshot.

    PYTHONPATH=src python docs/report_example.py [WORK_DIR]

Needs plotly and Debian's chromium; a few minutes on two CPU cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REWARD = '''
def digits(prompt, completion, **row):
    """Share of digit characters: dense, so a few steps on a random model move it."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)
'''


def main(work: Path) -> None:
    from rlft.api import train
    from rlft.models.tiny import build_tiny_model
    from rlft.monitor.monitor import Monitor
    from rlft.monitor.report import write_report

    torch.set_num_threads(1)
    model = build_tiny_model(work / "model", seed=0)
    (work / "rewards.py").write_text(REWARD)
    for name, rows in (("prompts", range(32)), ("eval", range(100, 116))):
        (work / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}.", "answer": str(i)}) + "\n"
                                                    for i in rows))
    run = work / "grpo-digits"
    train({"method": "grpo", "output_dir": str(run), "seed": 0, "model": {"path": str(model)},
           "data": {"train": str(work / "prompts.jsonl"), "eval": str(work / "eval.jsonl")},
           "training": {"learning_rate": 1e-2, "max_steps": 30, "num_threads": 1, "lr_scheduler": "constant",
                        "eval_every": 10},
           "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 24},
           "rewards": [{"fn": f"{work / 'rewards.py'}:digits"}],
           "eval": {"max_examples": 16, "max_new_tokens": 24},
           "logging": {"progress": False, "sample_every": 5, "num_samples": 2}})
    # what the loop will do once wired: every logged record through the monitor
    (run / "events.jsonl").unlink(missing_ok=True)
    monitor = Monitor(run_dir=run)
    for line in (run / "metrics.jsonl").read_text().splitlines():
        for alert in monitor.observe(json.loads(line)):
            print(f"step {alert.step} {alert.detector}: {alert.message}")
    report = write_report([run], run / "report.html")
    png = Path(__file__).with_name("report-example.png")
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={work / 'profile'}", "--hide-scrollbars", "--window-size=1400,2400",
                    "--virtual-time-budget=5000", f"--screenshot={png}", report.as_uri()],
                   check=True, capture_output=True, timeout=120)
    print(report, png)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="rlft-report-")))
