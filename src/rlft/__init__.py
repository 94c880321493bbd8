"""rlft: reinforcement-learning fine-tuning of open-weight language models.

    import rlft
    summary = rlft.train("examples/sft.yaml", ["training.epochs=2"])   # or a dict, or a Config
    rlft.resume("runs/sft")

The entry points are loaded on first use, so `import rlft` stays light (no torch import).
"""

from __future__ import annotations

from typing import Any

__all__ = ["train", "resume"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rlft import api

        return getattr(api, name)
    raise AttributeError(f"module 'rlft' has no attribute {name!r}")
