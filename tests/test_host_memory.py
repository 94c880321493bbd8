"""release_free_heap (rlft.training.host_memory): freed tensors that glibc keeps in its heap go
back to the OS, on CPU runs; other devices are left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rlft.training import host_memory
from rlft.training.host_memory import release_free_heap


_FRAGMENT = """
import torch
from rlft.training.host_memory import release_free_heap

def rss_mb():
    return next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))

# in a fresh process, one 3 MiB free raises glibc's mmap threshold to 3 MiB: the next 3 MiB tensors
# come from the heap, and with the last one still live at its top, freeing the others returns nothing
first = torch.ones(3 * 2**20, dtype=torch.uint8)
del first
blocks = [torch.ones(3 * 2**20, dtype=torch.uint8) for _ in range(100)]
kept = blocks[-1]
before = rss_mb()
del blocks
freed = rss_mb()
release_free_heap(torch.device("cpu"))
print(before, freed, rss_mb(), int(kept.sum()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory._malloc_trim() is None,
                    reason="glibc's malloc_trim: Linux with glibc only")
def test_freed_heap_pages_go_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    before, freed, after, kept = (float(x) for x in out.stdout.split())
    assert kept == 3 * 2**20
    assert freed > before - 100, (before, freed)  # free() kept the pages resident
    assert after < freed - 200, (freed, after)  # ~297 MiB handed back


def test_only_cpu_runs_trim(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "_malloc_trim", lambda: calls.append)
    release_free_heap(torch.device("meta"))
    assert calls == []
    release_free_heap(torch.device("cpu"))
    assert calls == [0]
