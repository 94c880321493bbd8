"""Crash-safe checkpoints.

Layout: `checkpoints/step-00000012/{model/ | adapter/, trainer_state.pt, [dcp/], manifest.json,
COMPLETE}` and a `checkpoints/latest` file naming the newest complete one. `dcp/` holds the sharded
state of a distributed run (torch.distributed.checkpoint, one part per rank); the model itself is
always written whole, so any checkpoint loads in one process or on any number of ranks.

A checkpoint is written into a temp folder beside its final name, every file fsynced, then the
manifest (SHA-256 of every file) and a `COMPLETE` marker, then the folder is renamed and `latest`
updated. A kill at any moment leaves either the old state or the new one. The loader verifies the
marker and the hashes and skips (and reports) anything incomplete or corrupt. Old checkpoints are
removed only after the new one is complete.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from rlft.models.template import write_template_record
from rlft.monitor.rundir import RunDirError, describe_os_error, os_error_of, write_text_atomic, writing
from rlft.training.distributed import SINGLE, World

log = logging.getLogger(__name__)

PREFIX = "step-"
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "dcp"  # distributed runs: every rank's shard of the optimizer (and critic) state
# Fault injection for crash tests: RLFT_FAULT="<stage>@<step>" SIGKILLs this process at that point of
# saving the checkpoint of that step (ckpt-model, ckpt-state, ckpt-rename, ckpt-done).
FAULT_ENV = "RLFT_FAULT"


def fault_point(stage: str, step: int) -> None:
    if os.environ.get(FAULT_ENV) == f"{stage}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def package_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("rlft", "torch", "transformers", "peft"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_model_weights(model: Any, is_lora: bool, directory: Path) -> None:
    """Adapter (peft format) under LoRA, else the full model (transformers format)."""
    model.save_pretrained(directory / ("adapter" if is_lora else "model"))


def load_model_weights(model: Any, is_lora: bool, directory: Path) -> None:
    from safetensors.torch import load_file

    sub = directory / ("adapter" if is_lora else "model")
    state: dict[str, torch.Tensor] = {}
    for file in sorted(sub.glob("*.safetensors")):
        state.update(load_file(file))
    if is_lora:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"{sub}: adapter keys do not match the model: {unexpected[:3]}")
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded_ptrs = {p.data_ptr() for n, p in model.named_parameters() if n in state}
    params = dict(model.named_parameters())
    really_missing = [k for k in missing if k in params and params[k].data_ptr() not in loaded_ptrs]
    if unexpected or really_missing:
        raise RuntimeError(f"{sub}: checkpoint does not match the model (missing {really_missing[:3]}, "
                           f"unexpected {unexpected[:3]})")


def checkpoint_path(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"{PREFIX}{step:08d}"


def save_checkpoint(checkpoints: Path, step: int, model: Any, is_lora: bool, tokenizer: Any,
                    trainer_state: dict[str, Any], keep_last: int, protect: set[str] | None = None,
                    world: World = SINGLE, sharded: dict[str, Any] | None = None) -> Path:
    """Write `step-N/` atomically (see the module docstring). A failed write (a full disk, say)
    removes its temporary folder, so the space is back and the last good checkpoint stays the
    newest one a resume finds; the error names the path and the fix.

    In a distributed run every rank calls this: rank 0 writes the model (full weights, from the
    unsharded copy), the trainer state and the manifest; `sharded` state (optimizer states, a
    critic's shards) is written by every rank into `dcp/` with torch.distributed.checkpoint."""
    final = checkpoint_path(checkpoints, step)
    name = final.name
    tmp = checkpoints / (f".tmp-{name}-{os.getpid()}" if not world.active else f".tmp-{name}-ranks")
    try:
        if world.main:
            _write_checkpoint(tmp, step, model, is_lora, tokenizer, trainer_state)
        world.barrier()
        if sharded:
            import torch.distributed.checkpoint as dcp

            dcp.save(sharded, checkpoint_id=str(tmp / SHARDED_DIR))
        world.barrier()
        if world.main:
            _seal(tmp, step)
    except BaseException as exc:
        # Whatever stopped the write (a full disk, a kill signal turned into an exception, a bug),
        # the partial folder goes: it holds the space a full disk needs back.
        failed = _WriteFailed.unwrap(exc, tmp)
        free_at_failure = _free_bytes(checkpoints)
        written = _tree_size(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        # the OS error however the writer reported it (safetensors: in its text; torch: as context)
        cause = os_error_of(failed.cause)
        if cause is None and not out_of_space(failed.cause, free_at_failure):
            raise failed.cause from None  # not a write problem: keep its traceback
        latest = find_latest(checkpoints)
        kept = f"the last good checkpoint is {latest}, still the newest" if latest else "no earlier checkpoint exists"
        what = f"saving checkpoint {name} ({kept}; the partial save was removed)"
        if out_of_space(cause or failed.cause, free_at_failure):
            raise RunDirError(_no_space_message(failed.path, what, checkpoints, latest, written,
                                                keep_last)) from None
        raise RunDirError(describe_os_error(cause, what, failed.path)) from None
    if world.main:
        fault_point("ckpt-rename", step)
        with writing(f"publishing checkpoint {name}", final):
            if final.exists():  # a stale one from a run resumed at an earlier step
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(checkpoints)
            latest_tmp = checkpoints / "latest.tmp"
            latest_tmp.write_text(name + "\n")
            os.replace(latest_tmp, checkpoints / "latest")
            _fsync_dir(checkpoints)
        prune(checkpoints, keep_last, protect or set())
        fault_point("ckpt-done", step)
    world.barrier()
    return final


def _write_checkpoint(tmp: Path, step: int, model: Any, is_lora: bool, tokenizer: Any,
                      trainer_state: dict[str, Any]) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with _WriteFailed.naming(tmp / ("adapter" if is_lora else "model")):
        save_model_weights(model, is_lora, tmp)
    with _WriteFailed.naming(tmp / "rlft_template.json"):
        write_template_record(tmp, tokenizer)
    fault_point("ckpt-model", step)
    # through a file object we own: torch's own writer, given a name, keeps the file open after a
    # failed write, and a deleted but open file still fills the disk
    with _WriteFailed.naming(tmp / STATE_FILE), (tmp / STATE_FILE).open("wb") as f:
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, f)
    fault_point("ckpt-state", step)


class _WriteFailed(Exception):
    """An exception raised while writing `path` of a checkpoint (torch and safetensors do not say
    which file they were writing)."""

    def __init__(self, path: Path, cause: BaseException):
        super().__init__(f"{path}: {cause}")
        self.path, self.cause = path, cause

    @classmethod
    @contextmanager
    def naming(cls, path: Path) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            raise cls(path, exc) from exc

    @classmethod
    def unwrap(cls, exc: BaseException, folder: Path) -> "_WriteFailed":
        if isinstance(exc, cls):
            return exc
        return cls(Path(getattr(exc, "filename", None) or folder), exc)


# How a full disk shows up when the writer is not Python's own I/O: torch's zip writer checks its
# position after each record ("unexpected pos N vs M", "PytorchStreamWriter failed writing file"),
# safetensors reports the OS error in its message text.
_NO_SPACE_TEXT = re.compile(r"no space left|os error 28|unexpected pos \d+ vs \d+|failed writing file|"
                            r"storagefull|disk quota", re.IGNORECASE)


def out_of_space(exc: BaseException, free_bytes: int | None = None) -> bool:
    """Whether `exc` means the disk (or quota) ran out. `free_bytes`, measured when the write
    failed, settles writer errors that do not say why (an almost full disk is reason enough)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(exc, OSError):
        return False
    return bool(_NO_SPACE_TEXT.search(str(exc))) or (free_bytes is not None and free_bytes < (1 << 20)
                                                      and isinstance(exc, RuntimeError))


def _no_space_message(path: Path, what: str, checkpoints: Path, latest: Path | None, written: int,
                      keep_last: int) -> str:
    free = _free_bytes(checkpoints)
    if latest is not None:  # the previous checkpoint is the best estimate of the next one's size
        need = f"a checkpoint needs about {_mb(_tree_size(latest))}"
    else:
        need = f"this checkpoint needs more than the {_mb(written)} it had written"
    have = f"{_mb(free)} is free there now" if free is not None else "the free space is unknown"
    return (f"no space left on the device of {path} while {what}: {need}, {have} (the one being written "
            f"must fit beside the last checkpoint.keep_last={keep_last}).\n"
            f"Fix: free space on that disk, lower checkpoint.keep_last, or choose an output_dir on another disk; "
            f"then continue with: rlft train --resume {checkpoints.parent}")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _tree_size(root: Path) -> int:
    try:
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    except OSError:
        return 0


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _seal(tmp: Path, step: int) -> None:
    """The manifest (SHA-256 of every file, the ranks' shards included) and the COMPLETE marker."""
    files = {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {"step": step, "created": time.time(), "versions": package_versions(), "files": files}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (tmp / MARKER).write_text("ok\n")
    _fsync_tree(tmp)


def load_sharded(path: Path, template: dict[str, Any]) -> dict[str, Any] | None:
    """The `dcp/` state of a checkpoint, laid out like `template` (this run's state dicts: DCP
    reshards a checkpoint written by any number of ranks onto this run's), or None when the
    checkpoint has none (written by one process)."""
    if not (path / SHARDED_DIR).is_dir():
        return None
    import torch.distributed.checkpoint as dcp

    dcp.load(template, checkpoint_id=str(path / SHARDED_DIR))
    return template


def remove_stale_temporaries(checkpoints: Path) -> None:
    """Temporary folders of saves that never finished (a crash, a full disk): the run directory is
    locked, so none of them belongs to a save in progress."""
    for stale in checkpoints.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def prune(checkpoints: Path, keep_last: int, protect: set[str]) -> None:
    complete = sorted(p for p in checkpoints.glob(f"{PREFIX}*") if (p / MARKER).exists())
    for old in complete[:-keep_last]:
        if old.name not in protect:
            shutil.rmtree(old, ignore_errors=True)
    remove_stale_temporaries(checkpoints)


def verify_checkpoint(path: Path) -> str | None:
    """None if the checkpoint is complete and intact, else the reason it is not."""
    if not (path / MARKER).exists():
        return "incomplete (no COMPLETE marker)"
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "unreadable manifest"
    for rel, digest in manifest["files"].items():
        file = path / rel
        if not file.is_file():
            return f"missing file {rel}"
        if _sha256(file) != digest:
            return f"corrupt file {rel} (SHA-256 mismatch)"
    return None


BEST_FILE = "best.json"


def read_best(checkpoints: Path) -> dict[str, Any] | None:
    path = checkpoints / BEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def record_best(checkpoints: Path, name: str, metric: str, value: float) -> None:
    write_text_atomic(checkpoints / BEST_FILE, json.dumps({"checkpoint": name, "metric": metric, "value": value}),
                      f"recording {name} as the best checkpoint")


def find_latest(checkpoints: Path) -> Path | None:
    """Newest complete, intact checkpoint; incomplete or corrupt ones are reported and skipped."""
    if not checkpoints.is_dir():
        return None
    candidates = sorted((p for p in checkpoints.glob(f"{PREFIX}*") if p.is_dir()), reverse=True)
    for path in candidates:
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


# Classes an async run's queued rollouts pickle, by the module they lived in when a checkpoint was
# written and the one they live in now: checkpoints from before the package layout of 2026-12
# (training/online/ and training/offline/) still resume.
MOVED_CLASSES = {("rlft.training.collect", "Rollout"): "rlft.training.online.collect"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED_CLASSES.get((module, name), module), name)


class _MovedClasses:
    """torch.load's `pickle_module`: pickle, with classes found where they live now."""
    Unpickler = _Unpickler
    load = staticmethod(pickle.load)  # torch.load reads through Unpickler; present for its checks
    __name__ = "pickle"


def load_trainer_state(path: Path) -> dict[str, Any]:
    # Our own file (optimizer state, RNG tuples with numpy arrays): not a weights-only pickle.
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False, pickle_module=_MovedClasses)
