"""Every write a run makes (checkpoints, the final export, metrics / samples / events, summary.json,
the report, logging backends) that fails is one clear error naming the path and the fix, and leaves
nothing half-written. A file-size limit (`ulimit -f`, RLIMIT_FSIZE) stands in for a full disk: the
write fails with EFBIG at a size the test chooses, and no root or tmpfs is needed."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DIGITS_REWARD
from rlft.errors import RlftError
from rlft.models.tiny import build_tiny_model
from rlft.monitor.loggers import LoggerGroup
from rlft.monitor.rundir import RunDirError, os_error_of

RLFT = str(Path(sys.executable).parent / "rlft")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("writes")
    build_tiny_model(root / "model", seed=0)  # its weights: ~3.7 MB of safetensors
    (root / "reward.py").write_text(DIGITS_REWARD)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(12)))
    return root


def grpo(root: Path, name: str, **sections) -> Path:
    cfg = {"method": "grpo", "output_dir": str(root / name), "seed": 0, "model": {"path": str(root / "model")},
           "data": {"train": str(root / "prompts.jsonl")},
           "training": {"learning_rate": 1e-2, "max_steps": 4, "num_threads": 1},
           "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
           "rewards": [{"fn": f"{root / 'reward.py'}:digits"}],
           "checkpoint": {"every": 2}, "logging": {"progress": False}, **sections}
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def rlft(*args: str, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """`rlft ARGS` in a child process whose files may not grow past `file_size_limit` bytes."""
    def limit() -> None:
        # ignored, so a write past the limit fails with EFBIG instead of the signal killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "250"}
    return subprocess.run([RLFT, *args], check=False, capture_output=True, text=True, timeout=300, env=env,
                          preexec_fn=limit if file_size_limit is not None else None)


def one_clear_error(result: subprocess.CompletedProcess) -> str:
    """Exit code 2, exactly one line starting with 'error:', no traceback; the error's text."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(starts) == 1, output[-3000:]
    return " ".join(" ".join(lines[starts[0]:]).split())  # as one line: the console wraps long ones


def test_a_failed_checkpoint_write_is_one_clear_error_and_the_run_says_it_failed(root):
    """Before: `ulimit -f 200; rlft train ... checkpoint.every=2` ended in a raw `SafetensorError ... File
    too large (os error 27)` traceback and no summary.json (safetensors raises its own error type,
    not OSError, so the checkpoint's handling let it through)."""
    out = root / "ckpt"
    error = one_clear_error(rlft("train", str(grpo(root, "ckpt")), file_size_limit=200 * 1024))
    assert f"cannot write {out / 'checkpoints'}/.tmp-step-00000002-" in error  # the path
    assert "while saving checkpoint step-00000002" in error and "the partial save was removed" in error
    assert "file-size limit (`ulimit -f`)" in error and "Fix: raise the limit (`ulimit -f unlimited`)" in error
    assert not list((out / "checkpoints").iterdir())  # no half-written checkpoint, complete-looking or not
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["step"] == 2 and "file-size limit" in summary["error"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_failed_final_export_leaves_no_half_final_and_running_again_finishes_it(root):
    """LoRA: the checkpoints (adapter only) fit under 1 MiB, the merged export does not. The export
    used to be a traceback with a half-written final/ (and the run 'complete' to a resume: nothing
    to train); now final/ appears whole or not at all and the run again finishes the export."""
    out = root / "export"
    config = grpo(root, "export", lora={"enabled": True, "r": 4, "alpha": 8})
    error = one_clear_error(rlft("train", str(config), file_size_limit=1 << 20))
    assert f"cannot write {out / 'final'} while exporting the final model" in error and "Fix: raise the limit" in error
    assert not (out / "final").exists() and not list(out.glob(".final.tmp-*"))
    assert (out / "checkpoints" / "step-00000004" / "COMPLETE").exists()  # the trained steps are safe
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["step"] == 4
    again = rlft("train", str(config))  # the limit lifted
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "the last attempt failed after it, finishing the run" in again.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 4 and "error" not in summary
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "adapter").is_dir()


def test_a_failed_report_write_is_one_clear_error_and_no_partial_file(root):
    run = root / "ckpt"
    if not (run / "metrics.jsonl").exists():
        pytest.skip("needs the run of the checkpoint test")
    report = root / "reports" / "r.html"
    error = one_clear_error(rlft("report", str(run), "--out", str(report), file_size_limit=100 * 1024))
    assert f"cannot write {report} while writing the report" in error  # plotly alone is ~4 MB
    assert "choose an --out file on another file system, then run `rlft report` again" in error
    assert list(report.parent.iterdir()) == []


CHILD = """
import json, resource, signal, sys
from pathlib import Path
from rlft.monitor.rundir import RunDir, RunDirError
run = RunDir(sys.argv[1])
run.root.mkdir()
run.log_metrics({"step": 1, "loss": 0.5})
run.update_summary({"status": "running", "step": 1})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = run.metrics_path.stat().st_size + 40  # room for part of the next line, not all of it
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
for write in (lambda: run.log_metrics({"step": 2, "loss": 0.25, "note": "x" * 100}),
              lambda: run.log_samples([{"step": 2, "completion": "y" * 30}, {"step": 2, "completion": "z" * 30}]),
              lambda: run.update_summary({"status": "completed", "note": "w" * 200})):
    try:
        write()
    except RunDirError as exc:
        print(json.dumps(str(exc)))
"""


def test_log_lines_and_the_summary_are_written_whole_or_not_at_all(tmp_path):
    """A line that does not fit used to stay half-written at the end of metrics.jsonl (the next
    reader, or a resume's truncation, met broken JSON); summary.json left its .tmp behind."""
    run = tmp_path / "run"
    child = subprocess.run([sys.executable, "-c", CHILD, str(run)], check=False, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.returncode == 0, child.stderr[-3000:]
    errors = [json.loads(line) for line in child.stdout.splitlines()]
    assert len(errors) == 3, child.stdout
    for error, path, what in zip(errors, ("metrics.jsonl", "samples.jsonl", "summary.json"),
                                 ("logging metrics", "logging samples", "writing summary.json")):
        assert f"cannot write {run / path} while {what}" in error and "Fix:" in error
    assert [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] == [{"step": 1, "loss": 0.5}]
    assert not (run / "samples.jsonl").exists() or (run / "samples.jsonl").read_text() == ""  # both lines or none
    assert json.loads((run / "summary.json").read_text()) == {"status": "running", "step": 1}
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "samples.jsonl", "summary.json"]  # no temps


def test_the_os_error_behind_each_writers_own_exception_is_found():
    from safetensors import SafetensorError

    assert os_error_of(SafetensorError("Error while serializing: I/O error: File too large (os error 27)")).errno \
        == errno.EFBIG
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as torch_error:  # torch.save into a file object: the OSError is its context
        assert os_error_of(torch_error).errno == errno.ENOSPC
    assert os_error_of(RuntimeError("shapes do not match")) is None
    assert os_error_of(ValueError("bad")) is None


class _FullDisk:
    log_dir = Path("/runs/x/tensorboard")

    def log_metrics(self, step, metrics):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        pass


def test_a_logging_backend_that_cannot_write_is_the_same_clear_error():
    with pytest.raises(RunDirError) as info:
        LoggerGroup([_FullDisk()]).log_metrics(1, {"loss": 1.0})
    assert str(info.value).startswith("no space left on the device of /runs/x/tensorboard while logging metrics to "
                                      "_FullDisk")
    assert isinstance(info.value, RlftError) and "\nFix: free space on that disk" in str(info.value)

