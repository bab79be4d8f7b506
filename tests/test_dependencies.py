"""Every declared dependency is used where it is declared: the runtime dependencies
are exactly the third-party packages tieredbuf/ imports (tieredbuf/spark/ takes its
own from the ``spark`` extra, the GCS store from the ``gcs`` extra), and tests/ and
bench/ import only what the runtime and their extra (``test``, ``bench``) declare."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
_DIST = packages_distributions()
_NOT_INSTALLED = {"persistqueue": "persist-queue"}
_NAMESPACES = {"google": "google-cloud-storage"}
"""Namespace packages several distributions share, by the one that is declared (the gcs
extra's google-cloud-storage brings google.auth and google.api_core with it)."""


def _names(reqs: list[str]) -> set[str]:
    """Normalised distribution names of requirement strings."""
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def _imported(paths: list[Path], local: set[str]) -> set[str]:
    """The distributions (normalised) that provide the top-level modules ``paths``
    import, leaving out the standard library and ``local`` modules."""
    mods: set[str] = set()
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module.split(".")[0])
    mods -= set(sys.stdlib_module_names) | local | {"__future__"}
    out = set()
    for m in mods:
        # a bench-only library need not be installed to be checked: its own name, or
        # the distribution name it is published under
        if m in _NAMESPACES:
            out.add(_NAMESPACES[m])
            continue
        dists = _DIST.get(m) or [_NOT_INSTALLED.get(m, m)]
        out.add(dists[0].lower().replace("_", "-"))
    return out


RUNTIME = _names(PROJECT["dependencies"])
EXTRAS = {k: _names(v) for k, v in PROJECT["optional-dependencies"].items()}
PKG = ROOT / "tieredbuf"
GCS = [PKG / "store" / "gcs.py", PKG / "store" / "gcs_open.py"]
"""The gs:// store: imported only for a gs:// URL (tieredbuf/store/__init__.py)."""


def test_runtime_dependencies_are_what_tieredbuf_imports() -> None:
    core = [
        p for p in PKG.rglob("*.py") if "spark" not in p.relative_to(PKG).parts and p not in GCS
    ]
    assert _imported(core, {"tieredbuf"}) == RUNTIME


def test_the_gcs_store_needs_only_the_runtime_and_the_gcs_extra() -> None:
    used = _imported(GCS, {"tieredbuf"})
    assert "google-cloud-storage" in used and used <= RUNTIME | EXTRAS["gcs"], used


def test_the_spark_source_needs_only_the_runtime_and_the_spark_extra() -> None:
    used = _imported(list((PKG / "spark").rglob("*.py")), {"tieredbuf"})
    assert "pyspark" in used and used <= RUNTIME | EXTRAS["spark"]


def test_tests_and_benchmarks_import_only_what_their_extra_declares() -> None:
    tests = _imported(list((ROOT / "tests").rglob("*.py")), {"tieredbuf", "tests"})
    missing = tests - RUNTIME - EXTRAS["test"]
    # packages a declared test dependency brings with it (moto[server] -> werkzeug,
    # boto3 -> botocore, google-cloud-storage -> requests) are fine to import
    assert missing <= {"werkzeug", "botocore", "requests"}, missing
    files = list((ROOT / "bench").rglob("*.py"))
    # bench/cost.py borrows the recording moto server from tests/servers.py (local code)
    bench = _imported(files, {"tieredbuf", "bench", "tests", *(p.stem for p in files)})
    assert bench - RUNTIME - EXTRAS["bench"] <= {"werkzeug", "botocore"}, bench
