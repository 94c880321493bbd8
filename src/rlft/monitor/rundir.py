"""The run directory: resolved config, metrics.jsonl, samples.jsonl, events.jsonl, summary.json,
data.json (what it trains on), checkpoints/, final/ -- everything needed to resume or report a run
with nothing else.

A run directory is marked (`.rlft-run`) and, while a run trains in it, locked (`.rlft-run.lock`,
an advisory lock the kernel drops when the process dies): rlft never adopts a folder of other
files, and two runs never write one folder at once. Failing writes (full disk, a file-size limit,
a read-only or unwritable location, a file where a folder should be) are one error naming the path
and the fix, and leave nothing half-written: files are replaced whole (`write_atomic`), log lines
appended whole (`append_lines`), folders swapped in whole (`folder_atomic`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from rlft.config import Config, dump_config, load_config
from rlft.data.fingerprint import describe, training_sources
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


@dataclass(frozen=True)
class Redo:
    """How an error's fix ends: where to write instead, and what to run once fixed."""
    place: str = "an output_dir"
    then: str = "start the run again (it continues from its newest checkpoint)"


RUN = Redo()  # the run directory's writes


@contextmanager
def writing(what: str, path: Path, redo: Redo = RUN) -> Iterator[None]:
    """Turn a failed write of `path` into one RunDirError that says what failed and how to fix it
    (a full disk, a file-size limit, a read-only or unwritable location, a file where a folder
    should be), however the writer reported it (see `os_error_of`). Any other error passes."""
    try:
        yield
    except RlftError:
        raise
    except Exception as exc:
        cause = os_error_of(exc)
        if cause is None:
            raise
        raise RunDirError(describe_os_error(cause, what, path, redo)) from None


# safetensors (Rust) reports an I/O error in its text only: "... File too large (os error 27)"
_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)")


def os_error_of(exc: BaseException) -> OSError | None:
    """The OS error behind `exc`, or None when it is not one. Python's own I/O raises OSError; the
    writers of weights do not: safetensors raises SafetensorError naming the errno in its text, and
    torch's zip writer raises RuntimeError ("unexpected pos N vs M") with the OSError of the file
    object it wrote to as its context."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        found = _OS_ERROR_TEXT.search(str(current))
        if found:
            number = int(found.group(1))
            return OSError(number, os.strerror(number))
        if "database or disk is full" in str(current):  # SQLite's word for it (MLflow's local store)
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        current = current.__cause__ or current.__context__
    return None


def describe_os_error(exc: OSError, what: str, path: Path, redo: Redo = RUN) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left on the device of {path} while {what}.\n"
                f"Fix: free space on that disk (or choose {redo.place} on another one), then {redo.then}")
    if exc.errno == errno.EFBIG:
        return (f"cannot write {path} while {what}: the file grew past this process's file-size limit "
                f"(`ulimit -f`) or the largest file that file system holds.\nFix: raise the limit "
                f"(`ulimit -f unlimited`) or choose {redo.place} on another file system, then {redo.then}")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (f"cannot write {path} while {what}: {exc.strerror}.\n"
                f"Fix: choose {redo.place} in a location this user can write")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return (f"cannot write {path} while {what}: a file stands where a folder is needed ({exc.strerror}).\n"
                f"Fix: move that file away, or choose {redo.place} elsewhere")
    return (f"cannot write {path} while {what}: {exc.strerror or exc}.\n"
            f"Fix: check the disk that holds it, or choose {redo.place} on another one, then {redo.then}")


def write_text_atomic(path: Path, text: str, what: str, redo: Redo = RUN) -> None:
    """`path` holds `text` whole, or (the write failed: one RunDirError) what it held before."""
    write_atomic(path, what, lambda tmp: tmp.write_text(text, encoding="utf-8"), redo)


def write_atomic(path: Path, what: str, write: Callable[[Path], None], redo: Redo = RUN) -> None:
    """`write(tmp)` writes a file beside `path` that is then renamed over it: `path` is whole or
    as before, and a failed write is one RunDirError naming `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(what, path, redo):
            write(tmp)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def append_lines(path: Path, lines: list[str], what: str) -> None:
    """Append `lines` ("\n"-terminated) to `path` all or none: a failed write cuts the file back
    to where it ended, so a reader (and a resume) never meets half a record."""
    data = "".join(lines).encode("utf-8")
    if not data:
        return
    with writing(what, path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:  # a write near a size limit or a full disk may write only part
                    view = view[os.write(fd, view):]
            except BaseException:
                os.ftruncate(fd, end)
                raise
        finally:
            os.close(fd)


@contextmanager
def folder_atomic(path: Path, what: str) -> Iterator[Path]:
    """A temporary folder beside `path` for the block to fill; when the block ends it replaces
    `path` whole. A failed write (one RunDirError naming `path`) removes it: no half-written folder
    is left, and a full disk gets its space back. Temporaries of a killed process go first."""
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(what, path):
            tmp.mkdir(parents=True)
            yield tmp
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    def data_path(self) -> Path:
        return self.root / "data.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final(self) -> Path:
        return self.root / "final"

    def create(self, config: Config) -> None:
        """Claim the folder (see `claim`) and write the resolved config."""
        self.claim(adopt=config.adopt_output_dir)
        with writing("creating its checkpoints folder", self.checkpoints):
            self.checkpoints.mkdir(exist_ok=True)
        write_atomic(self.config_path, "writing the run's config", lambda tmp: dump_config(config, tmp))

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

    def data_changes(self, config: Config, prints: dict[str, dict[str, Any]]) -> list[str]:
        """'FILE (SETTING) has changed ...: 2,000 lines, ... then, 50 lines, ... now' for each source whose
        fingerprint `prints` (rlft.data.fingerprint) differs from the one recorded when the run
        started. Sources without a record (a run from before rlft kept them) or gone now (their
        reader says so) are not compared."""
        saved = self._recorded_data()
        changes = []
        for setting, location in training_sources(config):
            then, now = saved.get(location), prints.get(location)
            if then is None or now is None or then == now:
                continue
            was, is_ = describe(then), describe(now)
            changes.append(f"{location} ({setting}) has changed since the run started: "
                           + (f"{was} then, {is_} now" if was != is_ else f"other content of the same size ({is_})"))
        return changes

    def record_data(self, prints: dict[str, dict[str, Any]], resumed: bool) -> None:
        """Keep the fingerprints of what the run trains on (data.json). A resumed run keeps those
        recorded when it started: they describe what its checkpoints were trained on."""
        if not self.writer:
            return
        recorded = {**prints, **self._recorded_data()} if resumed else prints
        write_text_atomic(self.data_path, json.dumps(recorded, indent=2), "recording the training data's fingerprints")

    def _recorded_data(self) -> dict[str, dict[str, Any]]:
        try:
            return json.loads(self.data_path.read_text())
        except (OSError, json.JSONDecodeError):  # none recorded (a run from an older rlft) or unreadable
            return {}

    def log_metrics(self, record: dict[str, Any]) -> None:
        if not self.writer:
            return
        append_lines(self.metrics_path, [jsonl_line(record)], "logging metrics")

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        if not self.writer:
            return
        append_lines(self.samples_path, [jsonl_line(r) for r in records], "logging samples")

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
            write_text_atomic(path, "".join(ln + "\n" for ln in keep), f"cutting {path.name} back to step {step}")

    def read_summary(self) -> dict[str, Any]:
        return json.loads(self.summary_path.read_text()) if self.summary_path.exists() else {}

    def update_summary(self, values: dict[str, Any]) -> dict[str, Any]:
        summary = self.read_summary()
        if "status" in values and "error" not in values:  # an error belongs to the status it explained
            summary.pop("error", None)
        summary.update(values)
        if not self.writer:
            return summary
        write_text_atomic(self.summary_path, json.dumps(_clean(summary), indent=2), "writing summary.json")
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


def jsonl_line(record: dict[str, Any]) -> str:
    """One JSON line, NaN/inf as null."""
    return json.dumps(_clean(record)) + "\n"


def fresh_dir(root: Path) -> Path:
    """A directory beside `root` that does not exist yet (root-2, root-3, ...): what an error
    suggests as another output_dir."""
    n = 2
    while (candidate := root.with_name(f"{root.name}-{n}")).exists():
        n += 1
    return candidate
