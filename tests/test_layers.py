"""The package's layer rules (docs/architecture.md, "Layers"), checked from the code's own
imports: every ``import`` of tieredbuf inside tieredbuf/, at module level, inside a
function or under ``TYPE_CHECKING`` alike.

* Dependencies point one way: each layer imports only the layers its rule names.
* No import cycle between modules, not even inside a function.
* No private name crosses a module: ``from x import _name`` of another module, or a
  private module of another folder.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "tieredbuf"

VOCABULARY = {"errors", "keys", "config"}
"""The words every layer speaks: the error tree, key names, frozen configs."""

RULES: dict[str, set[str]] = {
    "vocabulary": {"vocabulary"},
    "runtime": {"vocabulary", "runtime"},
    "format": {"vocabulary", "format"},
    "store": {"vocabulary", "runtime", "store"},
    "queue": {"vocabulary", "runtime", "format", "store", "queue"},
    "stage": {"vocabulary", "runtime", "format", "stage"},
    "produce": {"vocabulary", "runtime", "format", "store", "queue", "stage", "produce"},
    "consume": {"vocabulary", "runtime", "format", "store", "queue", "consume"},
    # the service's client: HTTP to `tieredbuf serve`, handles from the write path; it
    # never touches the store, the queue or the stage (the service does)
    "client": {"vocabulary", "runtime", "produce", "client"},
    "facade": {
        "vocabulary",
        "runtime",
        "format",
        "store",
        "queue",
        "produce",
        "consume",
        "client",
        "ops",
        "facade",
    },
    "ops": {
        "vocabulary",
        "runtime",
        "format",
        "store",
        "queue",
        "produce",
        "consume",
        "client",
        "facade",
        "ops",
    },
    # the front ends use the public API: the facade and what its methods return, never
    # the local tier's internals (stage/); the CLI starts the service
    "spark": {
        "vocabulary",
        "runtime",
        "format",
        "store",
        "queue",
        "produce",
        "consume",
        "client",
        "facade",
        "ops",
        "spark",
    },
    "service": {
        "vocabulary",
        "runtime",
        "format",
        "store",
        "queue",
        "produce",
        "consume",
        "client",
        "facade",
        "ops",
        "service",
    },
    "cli": {
        "vocabulary",
        "runtime",
        "format",
        "store",
        "queue",
        "produce",
        "consume",
        "client",
        "facade",
        "ops",
        "service",
        "cli",
    },
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "buffer":
        return "facade"
    if parts[1] in VOCABULARY:
        return "vocabulary"
    return parts[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    p = PKG.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports() -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported module, a name it takes from it or "")}."""
    out: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in sorted(PKG.rglob("*.py")):
        mod = _module_name(path)
        out[mod]
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("tieredbuf"):
                        out[mod].add((a.name, ""))
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module
                and (node.module == "tieredbuf" or node.module.startswith("tieredbuf."))
            ):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if _is_module(sub):
                        out[mod].add((sub, ""))
                    else:
                        out[mod].add((node.module, a.name))
    return out


def test_every_layer_imports_only_what_its_rule_allows() -> None:
    wrong = []
    for mod, targets in imports().items():
        mine = layer_of(mod)
        for target, _ in targets:
            theirs = layer_of(target)
            if theirs not in RULES[mine]:
                wrong.append(f"{mod} ({mine}) imports {target} ({theirs})")
    assert wrong == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_not_even_inside_a_function() -> None:
    graph = {m: {t for t, _ in ts if t != m} for m, ts in imports().items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _folder(module: str) -> str:
    is_package = (PKG.parent.joinpath(*module.split(".")) / "__init__.py").is_file()
    return module if is_package else module.rsplit(".", 1)[0]


def test_no_private_name_crosses_a_module() -> None:
    crossing = []
    for mod, targets in imports().items():
        for target, name in targets:
            last = target.rsplit(".", 1)[-1]
            if name.startswith("_") and not name.startswith("__"):
                crossing.append(f"{mod} takes {name} from {target}")
            elif last.startswith("_") and _folder(target) != _folder(mod):
                crossing.append(f"{mod} imports {target}, private to its folder")
    assert crossing == []
