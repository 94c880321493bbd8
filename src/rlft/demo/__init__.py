"""`rlft demo`: a tiny model learns worked two-digit addition -- SFT teaches the format, RL
teaches being right. `run.py` runs it; `arithmetic.py` makes its data (and the preference pairs
of the DPO and reward-model examples)."""

from rlft.demo.tiny import DemoSettings, run_demo

__all__ = ["DemoSettings", "run_demo"]
