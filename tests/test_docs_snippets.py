"""Every code block in README.md, docs/*.md and localstack/README.md runs as written,
or carries a marker saying why it cannot.

The rules (also in docs/getting-started.md, "How the docs are tested"):

* A page's blocks run in document order in one temporary working directory.
* ``s3://BUCKET/PATH`` becomes the ``file://`` buffer ``<that directory>/s3/BUCKET/PATH``
  (the S3-only options ``endpoint``, ``region``, ``--allow-http`` and the like are
  dropped), and ``start_http_server(9100)`` listens on a free port instead.
* A ```python block runs in a fresh namespace.
* A ```bash block runs whole under ``bash -euo pipefail`` with the virtualenv's ``bin``
  first on PATH (``.venv/bin/`` prefixes dropped) and must exit 0.
* A marker is an HTML comment on the line right before the fence,
  ``<!-- snippet: KIND reason -->``, KIND one of: ``continues`` (a python block that runs
  in the namespace of the page's previous python block); ``ci`` (a bash block whose
  other commands .ci/run runs: only its ``tieredbuf`` commands run here); and
  ``needs-aws``, ``needs-docker``, ``needs-spark``, ``manual`` (not run here; the reason
  is required and reported).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tieredbuf

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "localstack" / "README.md"]
EXE = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
MARKER = re.compile(r"<!--\s*snippet:\s*([a-z-]+)\s*(.*?)\s*-->")
KINDS = {"continues", "needs-aws", "needs-docker", "needs-spark", "ci", "manual"}
S3_URL = re.compile(r"s3://([a-z0-9.-]+)/([A-Za-z0-9_./-]*)")
SKIPPED = ("needs-aws", "needs-docker", "needs-spark", "manual")
S3_ONLY = ("endpoint", "region", "allow_http", "instance_metadata", "skip_signature",
           "access_key_id", "secret_access_key")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    marker: str | None
    reason: str
    index: int

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks() -> list[Block]:
    out: list[Block] = []
    for page in PAGES:
        lines = page.read_text("utf-8").splitlines()
        i = 0
        n = 0
        while i < len(lines):
            m = re.match(r"^```(\w+)\s*$", lines[i])
            if not m:
                i += 1
                continue
            start = i
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            prev = lines[start - 1] if start else ""
            mk = MARKER.search(prev)
            lang = m.group(1)
            if lang in ("python", "bash", "sh"):
                out.append(Block(page, start + 1, "bash" if lang == "sh" else lang,
                                 "\n".join(lines[start + 1:j]) + "\n",
                                 mk.group(1) if mk else None, mk.group(2) if mk else "", n))
                n += 1
            i = j + 1
    return out


ALL = blocks()


def test_markers_are_known_and_every_page_was_read() -> None:
    assert any(b.page.name == "README.md" for b in ALL)
    for b in ALL:
        assert b.marker is None or b.marker in KINDS, f"{b.id}: unknown marker {b.marker}"
        if b.marker in SKIPPED:
            assert b.reason, f"{b.id}: a {b.marker} marker says why"


def _local(url: str, work: Path) -> str:
    return S3_URL.sub(lambda m: f"file://{work}/s3/{m.group(1)}/{m.group(2)}", url)


def _file_open(work: Path) -> Any:
    real = tieredbuf.buffer.open

    def fake(url: str, **options: Any) -> tieredbuf.Buffer:
        if url.startswith("s3://"):
            url = _local(url, work)
            options = {k: v for k, v in options.items() if k not in S3_ONLY}
        return real(url, **options)

    return fake


def _bash(code: str, work: Path) -> str:
    code = re.sub(r"\\\n\s*", " ", code)  # continuations
    code = _local(code, work)
    code = re.sub(r"\s--(endpoint|region)[ =]\S+", "", code)
    code = code.replace(" --allow-http", "").replace(".venv/bin/", "")
    return code


def _commands(code: str) -> list[str]:
    out = []
    for line in re.sub(r"\\\n\s*", " ", code).splitlines():
        line = re.sub(r"\s+#.*$", "", line.strip())
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _ci_normal(text: str) -> str:
    return " ".join(text.replace(" -q ", " ").split())


def _run_bash(b: Block, work: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(EXE).parent}{os.pathsep}{os.environ['PATH']}"}
    if b.marker == "ci":
        ci = _ci_normal((ROOT / ".ci" / "run").read_text("utf-8"))
        code = []
        for cmd in _commands(b.code):
            if cmd.split()[0] in ("tieredbuf", ".venv/bin/tieredbuf"):
                code.append(cmd)
            else:
                assert _ci_normal(cmd) in ci, f"{b.id}: .ci/run does not run {cmd!r}"
        script = "\n".join(code)
    else:
        script = b.code
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", _bash(script, work)], cwd=work,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{b.id} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"


RUN_PAGES = [p for p in PAGES if any(b.page == p for b in ALL)]


@pytest.mark.parametrize("page", RUN_PAGES, ids=[p.relative_to(ROOT).as_posix() for p in RUN_PAGES])
def test_page_runs_as_written(page: Path, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tieredbuf, "open", _file_open(work))
    ns: dict[str, Any] = {}
    ran, skipped = [], []
    for b in (x for x in ALL if x.page == page):
        if b.marker in SKIPPED:
            skipped.append(f"{b.id} ({b.marker}: {b.reason})")
            continue
        if b.lang == "bash":
            _run_bash(b, work)
        else:
            if b.marker != "continues":
                ns = {"__name__": "__snippet__"}
            code = b.code.replace("start_http_server(9100)", "start_http_server(0)")
            exec(compile(code, f"{page.name}:{b.line}", "exec"), ns)
        ran.append(b.id)
    print(f"ran {ran}; not run here: {skipped}")
    assert ran or skipped


def test_getting_started_is_walked_whole() -> None:
    """docs/getting-started.md: every block but the Spark one runs."""
    page = [b for b in ALL if b.page.name == "getting-started.md"]
    assert len(page) >= 10
    assert [b.marker for b in page if b.marker in SKIPPED] == ["needs-spark"]
