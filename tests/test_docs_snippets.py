"""Every code block in README.md and docs/*.md runs as written, or says why it cannot.

The rules (also in docs/getting-started.md, "How the docs are tested"):

* Fenced ```python blocks run, each in a fresh namespace, in a temporary working
  directory.  An ``s3://bucket/...`` URL is replaced by a temporary ``file://`` buffer
  (``tieredbuf.open`` drops the S3-only options ``endpoint``, ``region`` and the like),
  and ``start_http_server(9100)`` listens on a free port instead.
* Fenced ```bash blocks: each command (``\\`` continuations joined, comments dropped)
  that starts with ``tieredbuf`` or ``.venv/bin/tieredbuf`` runs the real executable
  with the same URL substitution (and ``--endpoint X`` / ``--region X`` dropped); it
  must exit 0.  Any other command must be run by ``.ci/run`` (the README's set-up and
  test commands) or the block must carry a marker.
* A marker is an HTML comment on the line right before the fence:
  ``<!-- snippet: KIND reason -->`` with KIND one of
  ``continues`` (run in the namespace of the page's previous python block),
  ``needs-aws``, ``needs-docker``, ``needs-spark`` (skipped here with the reason; the
  Spark blocks run in tests/spark/test_spark_docs.py when that exists), ``ci``
  (commands .ci/run runs) and ``manual`` (long runs by hand, e.g. benchmarks).
"""

from __future__ import annotations

import re
import shlex
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
S3_URL = re.compile(r"s3://bucket/[A-Za-z0-9_./-]*")
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
        if b.marker in ("needs-aws", "needs-docker", "needs-spark", "manual"):
            assert b.reason, f"{b.id}: a {b.marker} marker says why"


def _file_open(url_for: Any) -> Any:
    real = tieredbuf.buffer.open

    def fake(url: str, **options: Any) -> tieredbuf.Buffer:
        if url.startswith("s3://"):
            url = url_for(url)
            options = {k: v for k, v in options.items() if k not in S3_ONLY}
        return real(url, **options)

    return fake


def _python_blocks() -> list[Any]:
    return [pytest.param(b, id=b.id) for b in ALL if b.lang == "python"]


def _chain(b: Block) -> list[Block]:
    page_blocks = [x for x in ALL if x.page == b.page and x.lang == "python"]
    k = page_blocks.index(b)
    chain = [b]
    while k > 0 and page_blocks[k].marker == "continues":
        k -= 1
        chain.insert(0, page_blocks[k])
    return chain


@pytest.mark.parametrize("block", _python_blocks())
def test_python_snippet_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chain = _chain(block)
    for b in chain:
        if b.marker in ("needs-aws", "needs-docker", "needs-spark", "manual"):
            pytest.skip(f"{b.marker}: {b.reason}")
    monkeypatch.chdir(tmp_path)
    buffers: dict[str, str] = {}

    def url_for(s3: str) -> str:
        return buffers.setdefault(s3, f"file://{tmp_path}/buffer-{len(buffers)}")

    monkeypatch.setattr(tieredbuf, "open", _file_open(url_for))
    ns: dict[str, Any] = {"__name__": "__snippet__"}
    for b in chain:  # the blocks before this one in a ``continues`` run set the scene
        code = b.code.replace("start_http_server(9100)", "start_http_server(0)")
        exec(compile(code, f"{b.page.name}:{b.line}", "exec"), ns)


def _commands(code: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        out.append(re.sub(r"\s+#.*$", "", line))
    return out


def _substitute(cmd: str, tmp: Path) -> list[str]:
    argv = shlex.split(S3_URL.sub(f"file://{tmp}/buffer", cmd))
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--endpoint", "--region"):
            skip = True
            continue
        if a in ("--allow-http",):
            continue
        out.append(a)
    return out


def _bash_blocks() -> list[Any]:
    return [pytest.param(b, id=b.id) for b in ALL if b.lang == "bash"]


@pytest.mark.parametrize("block", _bash_blocks())
def test_bash_snippet_runs_or_is_marked(block: Block, tmp_path: Path) -> None:
    if block.marker in ("needs-aws", "needs-docker", "needs-spark", "manual"):
        pytest.skip(f"{block.marker}: {block.reason}")
    ci = (ROOT / ".ci" / "run").read_text("utf-8")
    for cmd in _commands(block.code):
        first = cmd.split()[0]
        if first in ("tieredbuf", ".venv/bin/tieredbuf"):
            argv = _substitute(cmd, tmp_path)
            r = subprocess.run([EXE, *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0, f"{block.id}: {cmd}\n{r.stdout}\n{r.stderr}"
            continue
        assert block.marker == "ci", f"{block.id}: {cmd!r} runs nowhere: mark the block"
        assert _ci_normal(cmd) in _ci_normal(ci), f"{block.id}: .ci/run does not run {cmd!r}"


def _ci_normal(text: str) -> str:
    return " ".join(text.replace(" -q ", " ").split())
