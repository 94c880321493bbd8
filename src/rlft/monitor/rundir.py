"""The run directory: resolved config, metrics.jsonl, samples.jsonl, events.jsonl, summary.json,
checkpoints/, final/ -- everything needed to resume or report a run with nothing else.

A run directory is marked (`.rlft-run`) and, while a run trains in it, locked (`.rlft-run.lock`,
an advisory lock the kernel drops when the process dies): rlft never adopts a folder of other
files, and two runs never write one folder at once. Failing writes (full disk, read-only or
unwritable location, a file where a folder should be) are one error naming the path and the fix.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rlft.config import Config, dump_config, load_config
from rlft.errors import RlftError

# Settings that may differ when an existing run directory is continued.
MAY_CHANGE = {"training.max_steps", "training.epochs", "checkpoint", "logging", "training.num_threads",
              "training.dist_timeout_s", "model.device",
              "training.eval_every", "output_dir", "monitor", "adopt_output_dir",
              # memory, not maths (the memory fit may choose them differently on another machine)
              "training.memory_limit_gb", "model.gradient_checkpointing", "training.micro_batch_size",
              "algorithm.micro_batch_size", "rollout.batch_size",
              # speed, not maths: the same losses and gradients to float rounding
              "training.shared_prefix"}
MARKER = ".rlft-run"
LOCK = ".rlft-run.lock"


class RunDirError(RlftError):
    """The run directory cannot be used or written."""


@contextmanager
def writing(what: str, path: Path) -> Iterator[None]:
    """Turn an OS error while writing `path` into one RunDirError that says what failed and how
    to fix it (a full disk, a read-only or unwritable location, a file where a folder should be)."""
    try:
        yield
    except RlftError:
        raise
    except OSError as exc:
        raise RunDirError(describe_os_error(exc, what, path)) from None


def describe_os_error(exc: OSError, what: str, path: Path) -> str:
    if exc.errno == errno.ENOSPC:
        fix = "free space on that disk (or choose an output_dir on another one), then resume the run"
        return f"no space left on the device of {path} while {what}.\nFix: {fix}"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (f"cannot write {path} while {what}: {exc.strerror}.\n"
                "Fix: choose an output_dir in a location this user can write")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return (f"cannot write {path} while {what}: a file stands where a folder is needed ({exc.strerror}).\n"
                "Fix: choose another output_dir, or move that file away")
    return f"cannot write {path} while {what}: {exc.strerror or exc}"


class RunDir:
    def __init__(self, root: str | Path, writer: bool = True):
        """`writer=False`: a reader of a directory another process writes (the other ranks of a
        distributed run): its logging calls write nothing."""
        self.root = Path(root)
        self.writer = writer
        self._lock_fd: int | None = None

    # -- claiming the folder ----------------------------------------------------------------
    def claim(self, adopt: bool = False) -> None:
        """Make (or reuse) the folder as this process's run directory: refuse a non-empty folder
        that is not an rlft run directory (unless `adopt`), and lock it against a second run."""
        if self.root.exists() and not self.root.is_dir():
            raise RunDirError(f"output_dir {self.root} is a file, not a folder.\n"
                              "Fix: choose another output_dir")
        with writing("creating the run directory", self.root):
            self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / MARKER
        others = [p.name for p in self.root.iterdir() if p.name not in (MARKER, LOCK)]
        if others and not marker.exists() and not adopt:
            shown = ", ".join(sorted(others)[:5]) + (" ..." if len(others) > 5 else "")
            raise RunDirError(
                f"output_dir {self.root} already holds files that are not an rlft run ({shown}): a run would "
                "overwrite its config.yaml and summary.json, append to its metrics.jsonl and mix its export "
                "into final/.\nFix: choose an empty or new output_dir, or set adopt_output_dir=true to use "
                "this folder anyway")
        self._lock()
        with writing("marking the run directory", marker):
            if not marker.exists():
                marker.write_text(json.dumps({"created": time.time()}) + "\n")

    def _lock(self) -> None:
        path = self.root / LOCK
        with writing("locking the run directory", path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirError(f"output_dir {self.root} is in use by {owner}.\n"
                              "Fix: wait for that run to end (or stop it), or choose another output_dir") from None
        owner = f"process {os.getpid()} on {socket.gethostname()} (since {time.strftime('%Y-%m-%d %H:%M:%S')})"
        os.ftruncate(fd, 0)
        os.write(fd, owner.encode())
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def samples_path(self) -> Path:
        return self.root / "samples.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.root / "summary.json"

    @property
    def events_path(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final(self) -> Path:
        return self.root / "final"

    def create(self, config: Config) -> None:
        """Claim the folder (see `claim`) and write the resolved config."""
        self.claim(adopt=config.adopt_output_dir)
        with writing("writing the run's config", self.config_path):
            self.checkpoints.mkdir(exist_ok=True)
            dump_config(config, self.config_path)

    def config_changes(self, config: Config) -> list[str]:
        """Dotted fields where `config` differs from the saved config.yaml, besides those a
        continued run may change (MAY_CHANGE)."""
        # re-validated, so fields added by a newer rlft compare as their defaults
        saved = load_config(self.config_path).model_dump(mode="json")
        diffs = _flat_diff(saved, config.model_dump(mode="json"))
        return [k for k in diffs if not any(k == p or k.startswith(p + ".") for p in MAY_CHANGE)]

    def length_changes(self, config: Config) -> list[str]:
        """'training.epochs 10 -> 2' for each step-count field where `config` differs from the saved
        config.yaml (a continued run may change them: it then trains to the new count)."""
        saved = load_config(self.config_path).training
        return [f"training.{name} {getattr(saved, name)} -> {getattr(config.training, name)}"
                for name in ("max_steps", "epochs") if getattr(saved, name) != getattr(config.training, name)]

    def log_metrics(self, record: dict[str, Any]) -> None:
        if not self.writer:
            return
        with writing("logging metrics", self.metrics_path):
            _append_jsonl(self.metrics_path, record)

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        if not self.writer:
            return
        with writing("logging samples", self.samples_path):
            for record in records:
                _append_jsonl(self.samples_path, record)

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def truncate_logs(self, step: int) -> None:
        """On resume, drop log lines written after the checkpoint we resume from, so the resumed
        run's logs read exactly like an uninterrupted run's."""
        if not self.writer:
            return
        for path in (self.metrics_path, self.samples_path, self.events_path):
            if not path.exists():
                continue
            keep = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= step]
            path.write_text("".join(ln + "\n" for ln in keep))

    def update_summary(self, values: dict[str, Any]) -> dict[str, Any]:
        summary = json.loads(self.summary_path.read_text()) if self.summary_path.exists() else {}
        summary.update(values)
        if not self.writer:
            return summary
        tmp = self.summary_path.with_suffix(".tmp")
        with writing("writing summary.json", self.summary_path):
            tmp.write_text(json.dumps(_clean(summary), indent=2))
            tmp.replace(self.summary_path)
        return summary


def _flat_diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _flat_diff(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(_clean(record)) + "\n")


def fresh_dir(root: Path) -> Path:
    """A directory beside `root` that does not exist yet (root-2, root-3, ...): what an error
    suggests as another output_dir."""
    n = 2
    while (candidate := root.with_name(f"{root.name}-{n}")).exists():
        n += 1
    return candidate
