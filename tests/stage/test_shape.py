"""The shape of tieredbuf/stage/: parts that hold their own state and are composed,
read from the source (ast), so a regression fails here rather than in review."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import tieredbuf.stage

STAGE = Path(tieredbuf.stage.__file__).parent
PACKAGE = "tieredbuf.stage"
MODULES = sorted(p for p in STAGE.glob("*.py"))


def _name(path: Path) -> str:
    return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _imports(path: Path) -> set[str]:
    """Every tieredbuf.stage module ``path`` imports, anywhere in it (top level, inside
    a function, under ``if TYPE_CHECKING:``)."""
    known = {_name(p) for p in MODULES}
    out: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            # ``from tieredbuf.stage import filesystem`` imports a submodule; any other
            # name comes from the package's __init__
            subs = {f"{PACKAGE}.{a.name}" for a in node.names}
            out |= {n if n in known else PACKAGE for n in subs}
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            out.add(node.module)
    out.discard(_name(path))
    return out


def test_no_import_cycle_inside_stage_not_even_in_a_function_or_under_type_checking() -> None:
    graph = {_name(p): _imports(p) for p in MODULES}
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle in {PACKAGE}: {' -> '.join(e.args[1])}")
    assert set(order) == set(graph)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_stage_module_stays_under_600_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) < 600


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_mixin_and_no_host_attributes_redeclared_under_type_checking(path: Path) -> None:
    tree = _tree(path)
    classes = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    assert not [c for c in classes if c.endswith("Mixin")]
    assert "TYPE_CHECKING" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
    }


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_private_name_crosses_a_module(path: Path) -> None:
    """No ``_name`` is imported from another module, and none is read off an imported
    module or off another object (only ``self._x`` and ``cls._x``)."""
    tree = _tree(path)
    crossing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            crossing += [p for p in parts if p.startswith("_") and p != "__future__"]
        elif isinstance(node, ast.Import):
            crossing += [p for a in node.names for p in a.name.split(".") if p.startswith("_")]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            crossing.append(ast.unparse(node))
    assert crossing == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_module_that_logs_logs_under_its_own_name(path: Path) -> None:
    calls = [
        n
        for n in ast.walk(_tree(path))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "getLogger"
    ]
    assert all(ast.unparse(c) == "logging.getLogger(__name__)" for c in calls)


def test_the_package_doc_has_a_line_for_every_module() -> None:
    doc = tieredbuf.stage.__doc__ or ""
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    listed = {row.split("`")[1] for row in rows}
    assert listed == {p.name for p in MODULES if p.stem != "__init__"}
