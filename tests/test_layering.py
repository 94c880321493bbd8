"""The architecture as code: every import between rlft's modules, read with `ast` (module-level and
function-local alike), goes down the layer order below or stays inside its room, and no two
modules import each other, directly or round a circle. docs/architecture.md states the same order.

Function-local imports of rlft modules are for start-up costs only: the CLI's commands (so `rlft
--help` answers without importing torch) and the package face's lazy `rlft.train`. Anywhere else
such an import says why on its line (`# lazy: ...`)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "rlft"

# Top to bottom; a module may import its own room and any room below it. A room is a package
# (its sub-packages are rooms of their own where listed) or a group of the root's modules.
LAYERS = [
    ["rlft.__main__", "rlft.cli"],
    ["rlft.demo"],
    ["rlft", "rlft.api", "rlft.pipeline"],  # the public faces
    ["rlft.training.online", "rlft.training.offline"],
    ["rlft.training"],
    ["rlft.plan"],
    ["rlft.eval"],
    ["rlft.monitor"],
    ["rlft.data"],
    ["rlft.rollout.agent"],
    ["rlft.rollout"],
    ["rlft.rewards"],
    ["rlft.models"],
    ["rlft.config"],
    ["rlft.algorithms"],
    ["rlft.errors", "rlft.paths"],
]
ROOMS = {room: depth for depth, rooms in enumerate(LAYERS) for room in rooms}
LAZY_ALLOWED = ("rlft.cli", "rlft")  # modules whose function-local rlft imports are their start-up cost


def modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def room_of(module: str) -> str:
    """The longest room name that is `module` or a package above it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ROOMS:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no layer: add its room to LAYERS (and docs/architecture.md)")


def targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The rlft modules an import statement loads (a name imported from a package counts as the
    submodule when there is one)."""
    if isinstance(node, ast.ImportFrom):
        base = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        if node.level:
            base = ".".join(base.split(".")[: len(base.split(".")) - node.level + 1])
            stem = f"{base}.{node.module}" if node.module else base
        else:
            stem = node.module or ""
        candidates = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in MODULES else stem for alias in node.names]
    else:
        candidates = [alias.name for alias in node.names]
    found = set()
    for name in candidates:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith("rlft"):
            found.add(name)
    return found - {module}


def type_checking_lines(tree: ast.Module) -> set[int]:
    return {n.lineno for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block) if hasattr(n, "lineno")}


def imports() -> list[tuple[str, str, int, bool]]:
    """(importer, imported, line, function-local) for every import between rlft modules. A
    package's own `__init__` importing its children is its face, not an arrow."""
    rows = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        skip = type_checking_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in skip:
                for target in targets(module, node):
                    if path.name == "__init__.py" and target.startswith(module + "."):
                        continue
                    rows.append((module, target, node.lineno, id(node) not in top))
    return rows


IMPORTS = imports()


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m not in ROOMS and not any(m.startswith(r + ".") for r in ROOMS)] == []


def test_imports_go_down_the_layers():
    upward = [f"{a}:{line} imports {b} ({room_of(a)} is above {room_of(b)} in LAYERS only if it comes first)"
              for a, b, line, _ in IMPORTS if ROOMS[room_of(b)] < ROOMS[room_of(a)]]
    assert upward == []


def test_no_two_modules_import_each_other_round_a_circle():
    graph = defaultdict(set)
    for a, b, _, _ in IMPORTS:
        graph[a].add(b)
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:  # depth-first; a grey node met again closes a circle
        state[node] = "grey"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "grey":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "black"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_rooms_on_one_layer_do_not_import_each_other():
    """Rooms that share a layer (training.online and training.offline) are peers."""
    sideways = [f"{a}:{line} imports {b}" for a, b, line, _ in IMPORTS
                if room_of(a) != room_of(b) and ROOMS[room_of(a)] == ROOMS[room_of(b)]
                and {room_of(a), room_of(b)} - {"rlft", "rlft.api", "rlft.pipeline", "rlft.cli", "rlft.__main__",
                                                "rlft.errors", "rlft.paths"}]
    assert sideways == []


def test_function_local_rlft_imports_say_why():
    lines = {m: p.read_text().splitlines() for m, p in MODULES.items()}
    unexplained = [f"{a}:{line} imports {b}" for a, b, line, local in IMPORTS
                   if local and room_of(a) not in LAZY_ALLOWED and "# lazy:" not in lines[a][line - 1]]
    assert unexplained == []


def test_the_order_is_the_one_docs_architecture_states():
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    stated = [line.split("`")[1] for line in doc.splitlines() if line.startswith("| ") and line.count("`") >= 2
              and line.split("`")[1].startswith("rlft")]
    assert stated == [room for rooms in LAYERS for room in rooms]


def test_the_command_starts_without_torch():
    """The lazy imports above earn their keep: `rlft --help` (the CLI's modules) loads no torch."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import sys, rlft.cli; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
