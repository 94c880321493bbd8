"""`rlft` as it sampled before issue 27, for the benchmark's "before" rows.

    python benchmarks/rlft_before.py train CONFIG.yaml

The `rlft` command, except that the HF engine prefills every row of a group separately (as
before one prefill per prompt; `HFEngine(share_prefill=False)`). The training side's "before"
is a config value, `training.shared_prefix: off`, which `harness.run_rlft(before=True)` writes
into the config; the engine's shared prefill has no config switch (its completions are the same
either way), so this benchmark-only launcher turns it off. Nothing else differs.
"""

from __future__ import annotations

import sys

from rlft.rollout import hf

_init = hf.HFEngine.__init__


def _init_per_row_prefill(self, *args, **kwargs):
    kwargs["share_prefill"] = False
    _init(self, *args, **kwargs)


hf.HFEngine.__init__ = _init_per_row_prefill

if __name__ == "__main__":
    from rlft.cli.app import main

    sys.argv[0] = "rlft"
    sys.exit(main())
