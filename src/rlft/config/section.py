"""The base of every config section, and the field checks several sections share (devices, local
paths)."""

from __future__ import annotations

import difflib
import re

from pydantic import BaseModel, ConfigDict

from rlft import paths


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


DEVICE_NAMES = ("auto", "cpu", "cuda", "cuda:N")



# names other tools use for the same thing
_DEVICE_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "cuda0": "cuda:0", "rocm": "cuda", "hip": "cuda"}



def check_device(value: str, field: str) -> str:
    """'auto', 'cpu', 'cuda' or 'cuda:N'; anything else (a typo, 'gpu', 'mps', which rlft does not
    run on) is refused here, not as a traceback from torch when the model moves."""
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    lowered = value.strip().lower()
    guess = _DEVICE_ALIASES.get(lowered)
    if guess is None and (lowered in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", lowered)):
        guess = lowered
    if guess is None and re.fullmatch(r"(gpu|cuda)?:?\d+", lowered):  # gpu1, gpu:1, cuda1, 1
        guess = "cuda:" + re.sub(r"\D", "", lowered)
    if guess is None:
        found = difflib.get_close_matches(lowered, ["auto", "cpu", "cuda"], n=1, cutoff=0.5)
        guess = found[0] if found else None
    hint = f" Did you mean {guess!r}?" if guess else ""
    extra = " (Apple's mps is not supported: rlft trains on CPU or CUDA GPUs)" if lowered == "mps" else ""
    raise ValueError(f"{field}: unknown device {value!r}{extra}.{hint} Use one of: {', '.join(DEVICE_NAMES)}")



def _local(value: str, field: str) -> str:
    """`value` as a local path of this system; an empty one or a Windows-style path is refused."""
    if not value.strip():
        raise ValueError(f"{field} is empty; give a path")
    problem = paths.foreign_path_problem(value, field)
    if problem:
        raise ValueError(problem)
    return value