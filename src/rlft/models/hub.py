"""Hub ids (models, `hf:` datasets) on a machine that cannot reach the hub: decided in seconds, not
after a minute of retries.

transformers looks every file of a hub id up online first and retries each failed request with
backoff: with no network a model that is not cached took ~75 s (30 retry lines, ~70 warnings)
before its error, and even a cached one paid the same wait before falling back to the cache. So
the hub is probed once per process, with a short timeout; when it cannot be reached, a cached
model loads from its snapshot folder in the cache and an uncached one stops at once with one
error saying why and what to do.
"""

from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Iterator

from rlft.errors import RlftError
from rlft.models.folder_checks import looks_local

PROBE_TIMEOUT_S = 3.0  # a reachable hub answers in well under a second; DNS failures return at once
# a folder a model or tokenizer download always has at least one of
MARKER_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")


@functools.lru_cache(maxsize=1)
def hub_unreachable() -> str | None:
    """None when the hub answers (any HTTP status counts), else why not. HF_HUB_OFFLINE=1 counts as
    unreachable without probing."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=PROBE_TIMEOUT_S)
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{constants.ENDPOINT} cannot be reached: {reason}"
    return None


def cached_snapshot(repo_id: str, revision: str | None = None) -> str | None:
    """The local folder of a cached hub id (no network), or None when it is not cached."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001  (not cached, an invalid id, a broken cache entry: all "not usable")
        return None
    return folder if any(os.path.isfile(os.path.join(folder, name)) for name in MARKER_FILES) else None


def hub_source(path: str, revision: str | None, what: str) -> str:
    """What to pass to from_pretrained for `path`: a local folder (`~` expanded); a hub id as is
    while the hub can be reached; while it cannot, a cached hub id's snapshot folder (a folder, so
    no file of it is looked up online: transformers' `local_files_only` does not reach every
    look-up, e.g. the adapter_config.json probe). An uncached hub id then is one RlftError naming
    the field, the reason and the fixes."""
    if looks_local(path):
        return os.path.expanduser(path)
    reason = hub_unreachable()
    if reason is None:
        return path
    folder = cached_snapshot(path, revision)
    if folder is not None:
        return folder
    raise RlftError(
        f"{what} {path!r} is a hub id that is not in the local Hugging Face cache, and the hub cannot be used "
        f"({reason}).\nFix: download it on a machine with network access (`hf download {path}`, then copy the "
        f"cache or the folder here), or point {what} at a local model folder (a local path starts with ./ or /)")


@contextmanager
def offline() -> Iterator[None]:
    """huggingface_hub and datasets in offline mode for the block (cached files only, no look-ups,
    so no retries): for `datasets.load_dataset`, which has no folder to hand it instead."""
    import datasets.config
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved

