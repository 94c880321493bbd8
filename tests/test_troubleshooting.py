"""docs/troubleshooting.md covers every error class a user can hit: each `RlftError` subclass of
rlft.errors (the base included) has a section of its own, titled with the class name, showing a real
message (a fenced block with its `error:` line), what it means and the fix; and every `RlftError`
subclass defined elsewhere in the package (the run directory's, the sampler's, ...) is named on the
page. The classes are read from the code, so a new error class without a section fails here.

Fast: the classes of rlft.errors by introspection, the others from the source by `ast` (importing
every module would pull in vLLM and the rest); nothing is trained."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from rlft import errors

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"
SOURCE = ROOT / "src" / "rlft"
SECTION_FORM = ("## `Name`: what it is {#name}, then **What you see.** with a real message in a fenced "
                "block, **What it means.** and **Fix.**")


def error_classes() -> list[type]:
    """The user-facing error classes rlft.errors defines: RlftError and its subclasses there."""
    return [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
            if issubclass(cls, errors.RlftError) and cls.__module__ == errors.__name__]


def sections(text: str) -> dict[str, str]:
    """The page's `## ` sections by each class name written in code in their heading (`ConfigError`),
    body up to the next `## ` heading; headings inside fenced blocks do not count."""
    out: dict[str, str] = {}
    names: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            names = re.findall(r"`(\w+)`", line)
            for name in names:
                out[name] = ""
            continue
        for name in names:
            out[name] += line + "\n"
    return out


def fenced_blocks(body: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", body, re.MULTILINE | re.DOTALL)


def subclasses_in_source(known: set[str], files: list[Path]) -> dict[str, str]:
    """Classes of `files` deriving, directly or through each other, from a class named in `known`:
    name -> file (relative to src/rlft). Bases are matched by name (`RlftError`, `errors.RlftError`)."""
    defined: list[tuple[str, list[str], str]] = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                defined.append((node.name, bases, str(path.relative_to(SOURCE))))
    found: dict[str, str] = {}
    grew = True
    while grew:
        grew = False
        for name, bases, where in defined:
            if name not in known and name not in found and any(b in known or b in found for b in bases):
                found[name] = where
                grew = True
    return found


def test_every_error_class_of_rlft_errors_has_a_section():
    classes = error_classes()
    assert errors.RlftError in classes and len(classes) > 1, classes  # introspection found the module's classes
    titled = sections(PAGE.read_text())
    missing = [cls.__name__ for cls in classes if cls.__name__ not in titled]
    assert not missing, (f"docs/troubleshooting.md has no section for {missing}; add one per class: "
                         f"{SECTION_FORM}")


def test_each_section_shows_a_real_message_what_it_means_and_the_fix():
    titled = sections(PAGE.read_text())
    for cls in error_classes():
        body = titled.get(cls.__name__)
        if body is None:
            continue  # reported by the test above
        assert "**What you see.**" in body and "**What it means.**" in body and "**Fix.**" in body, \
            f"the section of {cls.__name__} lacks a part: {SECTION_FORM}"
        assert any(re.search(r"^error: ", block, re.MULTILINE) for block in fenced_blocks(body)), \
            f"the section of {cls.__name__} shows no message as the CLI prints it (a fenced block with 'error: ...')"


def test_error_classes_defined_elsewhere_in_the_package_are_named_on_the_page():
    """E.g. the run directory's error, or the sampler's, which a message may name."""
    files = sorted(SOURCE.rglob("*.py"))
    known = {cls.__name__ for cls in error_classes()}
    # the scan itself, checked on rlft.errors: from the base alone it finds every other class introspection does
    in_errors = subclasses_in_source({"RlftError"}, [SOURCE / "errors.py"])
    assert set(in_errors) == known - {"RlftError"}, in_errors
    elsewhere = subclasses_in_source(known, [f for f in files if f != SOURCE / "errors.py"])
    page = PAGE.read_text()
    unnamed = {name: where for name, where in elsewhere.items() if f"`{name}`" not in page}
    assert not unnamed, (f"RlftError subclasses not named on docs/troubleshooting.md: {unnamed}; give each a "
                         "section, or name it (`Name`) in the section of the error that carries it")
