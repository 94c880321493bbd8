"""Local paths in a config, made absolute when the config is loaded.

A run directory outlives the shell it was started from: `config.yaml` is read again by
`rlft train --resume DIR` and `rlft eval DIR` from any folder, and an adapter's
`adapter_config.json` names its base model for whoever loads it later. A relative path in either
works only from the original working directory, so every local path is stored absolute (`~`
expanded). Hub ids (`org/model`, `hf:NAME`) and importable modules (`package.module:function`)
stay as written.

Paths in another system's style (`C:\\data\\x.jsonl`, backslashes) never name a file here; they
are refused at load with the fix instead of surfacing later as "not found".
"""

from __future__ import annotations

import os
import re

from rlft.errors import RlftError

_WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


def foreign_path_problem(value: str, field: str) -> str | None:
    """Why `value` cannot be a path on this system (a Windows drive or backslashes), else None."""
    if os.sep == "\\":
        return None
    if _WINDOWS_DRIVE.match(value) or ("\\" in value and not os.path.exists(value)):
        fixed = re.sub(r"\\+", "/", _WINDOWS_DRIVE.sub("", value))
        return (f"{field}: {value!r} is a Windows-style path; this system separates folders with '/' and has no "
                f"drive letters. Fix: give the path as this machine sees it, e.g. {fixed!r} (relative) or an "
                "absolute /... path")
    return None


def absolute(value: str) -> str:
    """`~` expanded, made absolute against the working directory, `..` and `.` folded."""
    return os.path.abspath(os.path.expanduser(value))


def existing(value: str) -> str:
    """A path that exists here (relative to the working directory, or under `~`) made absolute;
    anything else as written: a hub id (a local folder shadows a hub id of the same name, as in
    transformers' from_pretrained), or a missing path, which its loader reports as the user wrote it."""
    return absolute(value) if os.path.exists(os.path.expanduser(value)) else value


# data sources that are no path here: a hub dataset, a generated task, a verifiers environment's dataset
NAMED_SOURCES = ("hf:", "reasoning_gym:", "verifiers:")


def is_named_source(value: str) -> bool:
    """`value` names a data source that is not a local path ('hf:NAME', 'reasoning_gym:TASK',
    'verifiers:train')."""
    return value.startswith(NAMED_SOURCES)


def data_location(value: str) -> str:
    """A data source: a named one (`is_named_source`) as written, else as `existing`."""
    return value if is_named_source(value) else existing(value)


def function_ref(value: str) -> str:
    """'path/file.py:function' with an existing file made absolute; 'package.module:function' as written."""
    target, sep, attr = value.rpartition(":")
    if sep and target.endswith(".py"):
        return f"{existing(target)}:{attr}"
    return value


def name_length_problem(value: str, field: str) -> str | None:
    """Why the absolute path `value` cannot be created here: a part longer than the file system's
    name limit (255 bytes on ext4, xfs, btrfs, tmpfs), which used to surface as a raw OSError
    (ENAMETOOLONG) from deep inside the first write."""
    parent = value
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    try:
        limit, whole = os.pathconf(parent, "PC_NAME_MAX"), os.pathconf(parent, "PC_PATH_MAX")
    except (OSError, ValueError):
        limit, whole = 255, 4096
    # the run writes files a few levels down (checkpoints/step-00000001/adapter/...): keep room for them
    room = 128
    if len(os.fsencode(value)) + room > whole:
        return (f"{field}: the path is {len(os.fsencode(value))} bytes long; with the files a run writes inside it, "
                f"it would pass the {whole}-byte path limit here. Fix: choose a shorter {field}")
    for part in value.split(os.sep):
        size = len(os.fsencode(part))
        if size > limit:
            shown = part[:40] + "..." if len(part) > 40 else part
            return (f"{field}: the name {shown!r} is {size} bytes long, over the {limit} bytes a file or folder name "
                    f"may have here. Fix: choose a shorter {field}")
    return None


# -- a path that exists but is not what the argument takes ------------------------------------------
# A config given a data file used to list every config field as missing, a binary one ended in a raw
# UnicodeDecodeError, a folder was "not found", and an output path naming a folder was a raw
# IsADirectoryError after the work was done. These name the argument, what the path is and what it
# takes; each returns None where the path is missing or fits (the reader then says the rest).

# what a file's suffix says it holds (not .txt: any text may be named so)
SUFFIX_KINDS = {
    ".yaml": "a YAML file", ".yml": "a YAML file", ".json": "a JSON file", ".jsonl": "a JSONL data file",
    ".parquet": "a Parquet data file", ".arrow": "an Arrow data file", ".csv": "a CSV file", ".tsv": "a TSV file",
    ".md": "a Markdown file", ".html": "an HTML page", ".py": "a Python file", ".gguf": "a GGUF model file",
    ".safetensors": "a safetensors weights file", ".bin": "a binary file", ".pt": "a torch checkpoint",
    ".pth": "a torch checkpoint", ".ckpt": "a checkpoint file", ".zip": "a zip archive", ".gz": "a gzip archive",
}
BINARY_SUFFIXES = (".parquet", ".arrow", ".gguf", ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".zip", ".gz")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # what rlft.data.readers reads
_RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "samples.jsonl", "events.jsonl", "report.html")


def is_binary(path: str | os.PathLike) -> bool:
    """The file's first 8 KiB hold a NUL byte or are not UTF-8 text (False where it cannot be read:
    whoever reads it says why)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError:
        return False
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < len(head) - 3  # else a character cut at the block's end
    return False


def describe(path: str | os.PathLike) -> str:
    """What an existing path is, in words: 'a folder', 'a Python file', 'a binary file' ..."""
    if os.path.isdir(path):
        return "a folder"
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in BINARY_SUFFIXES and is_binary(path):
        return "a binary file"
    return SUFFIX_KINDS.get(suffix) or (f"a {suffix} file" if suffix else "a file")


def _existing(path: str | os.PathLike) -> str | None:
    p = os.path.expanduser(os.fspath(path))
    return p if os.path.exists(p) else None


def _wrong_file(p: str, allowed: tuple[str, ...]) -> bool:
    """A file whose suffix names another kind than `allowed`, or binary content under any suffix."""
    suffix = os.path.splitext(p)[1].lower()
    return (suffix in SUFFIX_KINDS and suffix not in allowed) or (suffix not in BINARY_SUFFIXES and is_binary(p))


def config_file_problem(path: str | os.PathLike, arg: str, what: str = "a config YAML file") -> str | None:
    """`path` (given as `arg`) exists but is no YAML config: a folder, a data, code or model file, binary."""
    p = _existing(path)
    if p is None:
        return None
    if os.path.isdir(p):
        inside = os.path.join(p, "config.yaml")
        fix = (f"give the file itself; this folder holds one: {inside}" if os.path.isfile(inside)
               else "give the YAML file itself")
        return f"{arg} {path} is a folder, not {what}.\nFix: {fix}"
    if not _wrong_file(p, (".yaml", ".yml", ".json")):  # JSON is YAML too
        return None
    suffix = os.path.splitext(p)[1].lower()
    hint = {".jsonl": "data files are named inside the config (data.train: FILE.jsonl)",
            ".parquet": "data files are named inside the config (data.train: FILE.parquet)",
            ".py": "Python functions are named inside the config (rewards: [{fn: FILE.py:NAME}])",
            ".gguf": "a model is named inside the config (model.path: FILE.gguf)"}.get(suffix, "give the YAML file")
    return f"{arg} {path} is {describe(p)}, not {what}.\nFix: {hint}"


def run_dir_problem(path: str | os.PathLike, arg: str) -> str | None:
    """`path` (given as `arg`) exists but is a file, not a run directory."""
    p = _existing(path)
    if p is None or os.path.isdir(p):
        return None
    parent = os.path.dirname(os.path.abspath(p))
    fix = (f"give the run's folder, {parent}" if os.path.basename(p) in _RUN_FILES
           else "give a training run's output_dir (the folder holding config.yaml and metrics.jsonl)")
    return f"{arg} {path} is {describe(p)}, not a run directory.\nFix: {fix}"


def model_dir_problem(path: str | os.PathLike, arg: str, what: str = "a model folder or a run directory") -> str | None:
    """`path` (given as `arg`) exists but is a file other than a .gguf checkpoint."""
    p = _existing(path)
    if p is None or os.path.isdir(p) or p.lower().endswith(".gguf"):
        return None
    hint = " (held-out prompts go in --data)" if os.path.splitext(p)[1].lower() in DATA_SUFFIXES else ""
    return (f"{arg} {path} is {describe(p)}, not {what}.\nFix: give the folder holding config.json, the weights "
            f"and the tokenizer, or a training run's output_dir{hint}")


def data_file_problem(path: str, arg: str) -> str | None:
    """`path` (given as `arg`) is an existing file of another kind than the data readers take."""
    if is_named_source(path):
        return None
    p = _existing(path)
    if p is None or os.path.isdir(p) or not _wrong_file(p, DATA_SUFFIXES):  # a folder: a saved HF dataset
        return None
    return (f"{arg} {path} is {describe(p)}, not a data file.\nFix: give rows as .jsonl, .json or .parquet, a "
            "saved HF dataset folder, or hf:NAME")


def text_file_problem(path: str | os.PathLike, arg: str, what: str, allowed: tuple[str, ...], fix: str) -> str | None:
    """`path` (given as `arg`) exists but is a folder, binary, or of a kind `allowed` leaves out."""
    p = _existing(path)
    if p is None or not (os.path.isdir(p) or _wrong_file(p, allowed)):
        return None
    return f"{arg} {path} is {describe(p)}, not {what}.\nFix: {fix}"


def output_file_problem(path: str | os.PathLike, arg: str, what: str, example: str,
                        also: tuple[str, ...] = ()) -> str | None:
    """`path` (given as `arg`, where `what` will be written) is a folder, lies under a file, or is an
    existing file of another kind (a config, data, code) that writing would replace; `example`: a
    file name to suggest, whose suffix is the kind written (`also`: other suffixes that may be
    replaced). Checked before the work, which would otherwise end in a raw OSError or a lost file."""
    p = os.path.expanduser(os.fspath(path))
    if os.path.isdir(p):
        return (f"{arg} {path} is a folder, not a file to write {what} to.\n"
                f"Fix: name a file, e.g. {os.path.join(p, example)}")
    parent = os.path.dirname(os.path.abspath(p))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        return f"{arg} {path}: {parent} is {describe(parent)}, not a folder.\nFix: name a file in a folder"
    if os.path.isfile(p) and _wrong_file(p, (os.path.splitext(example)[1], *also)):
        return (f"{arg} {path} is {describe(p)}; writing {what} there would replace it.\nFix: name a new file, "
                f"e.g. {os.path.join(os.path.dirname(p), example)}")
    return None


def output_dir_problem(path: str | os.PathLike, arg: str, what: str) -> str | None:
    """`path` (given as `arg`, where `what` will be written) exists and is not a folder."""
    p = _existing(path)
    if p is None or os.path.isdir(p):
        return None
    return f"{arg} {path} is {describe(p)}, not a folder to write {what} to.\nFix: name a new folder"


def stop_on(*problems: str | None) -> None:
    """Raise the first of `problems` (the checks above) as an RlftError: one error line from the CLI."""
    for problem in problems:
        if problem:
            raise RlftError(problem)
