"""The READMEs' shell blocks run as written in a fresh shell (issue "Hard to misuse, round 4",
item 10). Before: README.md's "Using it" block began with `.venv/bin/rlft --help` and went on with
bare `rlft ...` ("command not found" unless the venv was on PATH), and the other blocks mixed the
two the same way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACTIVATE = "source .venv/bin/activate"


def shell_blocks(text: str) -> list[list[str]]:
    """The command lines of each ```bash block (continuation lines and comments left out)."""
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        lines, joined = [], ""
        for line in body.splitlines():
            joined += line.split("  #")[0].rstrip().rstrip("\\")
            if not line.rstrip().endswith("\\"):
                if joined.strip():
                    lines.append(joined.strip())
                joined = ""
        blocks.append(lines)
    return blocks


@pytest.mark.parametrize("readme", ["README.md", "examples/README.md"])
def test_every_shell_block_finds_rlft_the_way_it_says(readme):
    blocks = shell_blocks((ROOT / readme).read_text())
    assert blocks
    for lines in blocks:
        tools = [ln for ln in lines if re.match(r"(\S+/)?(rlft|torchrun|srun)\b", ln)]
        if not tools:
            continue  # make targets: they create and use .venv themselves
        assert ACTIVATE in lines and lines.index(ACTIVATE) < lines.index(tools[0]), (readme, lines)
        assert not [ln for ln in tools if ln.startswith(".venv/bin/")], (readme, lines)  # one way, not two
