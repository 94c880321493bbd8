"""Code-reward sandbox throughput: correct programs scored per second, and the active isolation layers.

    .venv/bin/python benchmarks/sandbox_throughput.py [--programs 48]

Each program runs in a fresh sandboxed interpreter (see rlft.rewards.code); the scorer calls
`run_program` from a thread pool, so the pool size is the number of sandboxes at once.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

from rlft.rewards.code import isolation_layers, run_program

PROGRAM = "def add(a, b):\n    return a + b\n"


def tests(cases: int) -> dict:
    return {"fn_name": "add", "cases": [{"input": [i, i + 1], "output": 2 * i + 1} for i in range(cases)]}


def rate(programs: int, threads: int, cases: int) -> float:
    spec = tests(cases)
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        verdicts = list(pool.map(lambda _: run_program(PROGRAM, spec, timeout=30), range(programs)))
    elapsed = time.perf_counter() - start
    bad = [v.status for v in verdicts if v.status != "ok"]
    if bad:
        raise SystemExit(f"unexpected verdicts: {bad[:5]}")
    return programs / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=48)
    args = ap.parse_args()
    layers = isolation_layers()
    rate(4, 4, 1)  # warm-up: uid pool, interpreter caches
    rows = [{"threads": t, "cases": c, "programs_per_s": round(rate(args.programs, t, c), 1)}
            for t in (1, 8) for c in (1, 5)]
    print(json.dumps({"cpus": os.cpu_count(), "load_average": os.getloadavg(), "layers": layers, "results": rows},
                     indent=1))


if __name__ == "__main__":
    main()
