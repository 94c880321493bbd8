"""A griffe extension (mkdocs.yml, mkdocstrings' python handler `extensions:`) for the Python API page.

rlft's docstrings start a list right under the sentence that introduces it ("... is:\n- `prompt` is ..."),
which reads well in the source; Markdown needs a blank line there, or the items run into the paragraph as
text. This adds that blank line when the page is built; the source stays as it is.
"""

from __future__ import annotations

from typing import Any

import griffe


def separate_lists(text: str) -> str:
    """A blank line before each list that directly follows a paragraph line."""
    out: list[str] = []
    in_list = False
    for line in text.split("\n"):
        item = line.lstrip().startswith(("- ", "* "))
        if item and not in_list and out and out[-1].strip():
            out.append("")
        if item:
            in_list = True
        elif not line.strip() or not line.startswith(" "):  # a blank line or an unindented one ends the list
            in_list = False
        out.append(line)
    return "\n".join(out)


class SeparateLists(griffe.Extension):
    def on_object(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = separate_lists(obj.docstring.value)
