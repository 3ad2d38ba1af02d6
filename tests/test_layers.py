"""Imports run one way: every module imports only from its own floor or the floors below it,
and no two modules import each other (directly or round a circle).

The floors are read from the diagram in docs/architecture.md (the block between the
``layers:begin`` / ``layers:end`` markers, top floor first), so the picture and this test cannot
drift apart. Every import counts, also one inside a function: a lazy import is still a
dependency.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("quantize", "formats", "calibrate", "eval")


def floors() -> list[tuple[str, list[str]]]:
    """``[(floor name, [path prefixes])]`` from docs/architecture.md, top floor first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers:begin -->\n```\n(.*?)```\n<!-- layers:end -->", text, re.S)
    assert block, "docs/architecture.md lost its layers:begin / layers:end diagram"
    out = []
    for line in block.group(1).splitlines():
        m = re.match(r"^\s*\d+\s+(\w+)\s+(.+?)\s*$", line)
        if m:
            out.append((m.group(1), [p.strip() for p in m.group(2).split(",")]))
    return out


def module_files() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


def floor_of(path: Path, table) -> int:
    """Index of the floor holding ``path`` (0 = bottom); the longest matching prefix wins."""
    rel = path.relative_to(ROOT).as_posix()
    best, best_len = None, -1
    n = len(table)
    for i, (_, prefixes) in enumerate(table):
        for p in prefixes:
            if (rel == p or (p.endswith("/") and rel.startswith(p))) and len(p) > best_len:
                best, best_len = n - 1 - i, len(p)
    assert best is not None, f"{rel} is on no floor of docs/architecture.md"
    return best


def imports_of(path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (``from a.b import c`` counts ``a.b.c`` when that is a
    module, else ``a.b``)."""
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                     for a in node.names]
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def graph():
    mods = module_files()
    return mods, {m: imports_of(f, mods) - {m} for m, f in mods.items()}


def back_edges(mods, edges, table) -> list[str]:
    """``"a (floor X) imports b (floor Y)"`` for every import that runs up a floor."""
    name = lambda i: table[len(table) - 1 - i][0]  # noqa: E731
    out = []
    for m, deps in sorted(edges.items()):
        fm = floor_of(mods[m], table)
        for d in sorted(deps):
            fd = floor_of(mods[d], table)
            if fd > fm:
                out.append(f"{m} (floor {name(fm)}) imports {d} (floor {name(fd)})")
    return out


def cycles(edges) -> list[str]:
    """Every import circle found by a depth-first walk, as ``a -> b -> a``."""
    state, found = {}, []

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                found.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    return found


def test_every_module_is_on_a_floor_and_imports_only_downwards():
    table = floors()
    assert [name for name, _ in table][-1] == "base"
    mods, edges = graph()
    assert not back_edges(mods, edges, table), "imports that run back up:\n" + "\n".join(
        back_edges(mods, edges, table))


def test_no_import_cycles():
    _, edges = graph()
    assert not cycles(edges), "import cycles:\n" + "\n".join(cycles(edges))


def test_a_planted_back_edge_and_circle_are_reported():
    """The checks can fail: an upward import from the formats floor, and a circle."""
    mods, edges = graph()
    table = floors()
    edges["formats.shards"] = edges["formats.shards"] | {"quantize.cli"}
    assert back_edges(mods, edges, table) == [
        "formats.shards (floor formats) imports quantize.cli (floor cli)"]
    edges["quantize.base.errors"] = edges["quantize.base.errors"] | {"formats.shards"}
    assert any(c.startswith("formats.shards -> ") and c.endswith(" -> formats.shards")
               for c in cycles(edges))
