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


def data_location(value: str) -> str:
    """A data source: 'hf:NAME' and 'reasoning_gym:TASK' as written, else as `existing`."""
    return value if value.startswith(("hf:", "reasoning_gym:")) else existing(value)


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

