"""Every code block in README.md, docs/*.md and localstack/README.md, and the recipe
in every example's docstring (examples/*.py), runs as written against a real S3 server
(moto), or carries a marker saying why it cannot.

The rules (also in docs/getting-started.md, "How the docs are tested"):

* A page's blocks run in document order, in one scratch working directory and one
  process (tests/doc_runner.py), as a reader's shell session: what a bash block exports
  is in the environment of the blocks after it, a server it starts in the background
  keeps running until the page ends.
* Only the endpoints are substituted: the S3 endpoint ``127.0.0.1:9000`` (and
  ``moto_server -p 9000``) becomes a free port -- the page's own moto server when the
  page starts one, else the test run's moto server, with the buckets the page names
  created empty and its keys in ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_REGION`` (what a reader has after getting-started's "A local S3") -- the
  service's ``127.0.0.1:8080`` / ``--port 8080`` becomes a free port, so do a GCS
  emulator's ``127.0.0.1:4443`` / ``-port 4443`` and Azurite's ``127.0.0.1:10000`` /
  ``--blobPort 10000``, and ``start_http_server(9100)`` listens on any free port.  A
  page that runs ``node_modules/.bin/azurite-blob`` finds the checkout's
  ``node_modules`` (where .ci/run installs Azurite) in its directory.  ``s3://`` URLs,
  options and commands are left as written.  ``HOME`` is the scratch directory (no
  ``~/.aws`` of the machine's).
* A ```python block runs in a fresh namespace; a ```bash block runs whole under
  ``bash -euo pipefail`` with the virtualenv's ``bin`` first on PATH (as after
  ``source .venv/bin/activate``, which is therefore not run; ``.venv/bin/`` prefixes
  are dropped) and must exit 0.
* An example's recipe is its docstring's lines indented by four spaces, run as one
  bash block in a directory where ``examples/`` is the repository's.
* A marker is an HTML comment on the line right before the fence,
  ``<!-- snippet: KIND reason -->``, KIND one of: ``continues`` (a python block that runs
  in the namespace of the page's previous python block); ``ci`` (a bash block whose
  other commands .ci/run runs: only its ``tieredbuf`` commands run here);
  ``needs-spark`` (runs in the page's Spark variant, which starts a JVM: marked
  ``spark`` and ``slow``); ``needs-docker``, ``manual`` (not run here; the reason is
  required and reported; not allowed in docs/ but for the benchmarks' own run).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.endpoint import S3Endpoint

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "localstack" / "README.md",
]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
EXE = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
RUNNER = Path(__file__).with_name("doc_runner.py")
MARKER = re.compile(r"<!--\s*snippet:\s*([a-z-]+)\s*(.*?)\s*-->")
KINDS = {"continues", "needs-docker", "needs-spark", "ci", "manual"}
NEVER_RUN = ("needs-docker", "manual")
ALLOWED_NOT_RUN = {"benchmarks.md"}
"""docs/ pages with a block that is never run: the benchmarks take ten minutes and
the bench extra (docs/benchmarks.md says how to run them)."""
S3_BUCKET = re.compile(r"s3://([a-z0-9][a-z0-9.-]+)/")
ACTIVATE = re.compile(r"^\s*(source|\.)\s+\.venv/bin/activate\s*$", re.M)
PAGE_TIMEOUT = 600.0


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    marker: str | None
    reason: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    out: list[Block] = []
    lines = page.read_text("utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        mk = MARKER.search(lines[start - 1] if start else "")
        lang = m.group(1)
        if lang in ("python", "bash", "sh"):
            out.append(
                Block(
                    page,
                    start + 1,
                    "bash" if lang == "sh" else lang,
                    "\n".join(lines[start + 1 : j]) + "\n",
                    mk.group(1) if mk else None,
                    mk.group(2) if mk else "",
                )
            )
        i = j + 1
    return out


def example_blocks(example: Path) -> list[Block]:
    """The docstring's lines indented by four spaces: one bash recipe."""
    text = example.read_text("utf-8")
    doc = re.match(r'\s*r?"""(.*?)"""', text, re.S)
    assert doc, f"{example.name} has no module docstring"
    first = None
    recipe = []
    for n, line in enumerate(doc.group(1).splitlines(), start=1):
        if line.startswith("    ") and line.strip():
            first = first or n
            recipe.append(line[4:])
    assert recipe, f"{example.name}: its docstring shows no command (lines indented 4)"
    return [
        Block(
            example,
            first or 1,
            "bash",
            "\n".join(recipe) + "\n",
            "needs-spark",
            "an example Spark job",
        )
    ]


ALL = [b for p in PAGES for b in page_blocks(p)] + [b for e in EXAMPLES for b in example_blocks(e)]


def test_markers_are_known_and_only_the_benchmarks_are_never_run() -> None:
    assert any(b.page.name == "README.md" for b in ALL)
    for b in ALL:
        assert b.marker is None or b.marker in KINDS, f"{b.id}: unknown marker {b.marker}"
        if b.marker in NEVER_RUN:
            assert b.reason, f"{b.id}: a {b.marker} marker says why"
            in_docs = b.page.parent in (ROOT, ROOT / "docs", ROOT / "examples")
            assert not in_docs or b.page.name in ALLOWED_NOT_RUN, (
                f"{b.id}: every snippet in README, docs/ and examples/ runs"
            )
        if b.marker == "needs-spark":
            assert b.reason, f"{b.id}: a needs-spark marker says why"


# --- one page's run ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _commands(code: str) -> list[str]:
    out = []
    for line in re.sub(r"\\\n\s*", " ", code).splitlines():
        line = re.sub(r"\s+#.*$", "", line.strip())
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _ci_normal(text: str) -> str:
    return " ".join(text.replace(" -q ", " ").split())


def ci_part(b: Block) -> str:
    """A ``ci`` block: its tieredbuf commands (the others must be in .ci/run)."""
    ci = _ci_normal((ROOT / ".ci" / "run").read_text("utf-8"))
    code = []
    for cmd in _commands(b.code):
        if cmd.split()[0] in ("tieredbuf", ".venv/bin/tieredbuf"):
            code.append(cmd)
        else:
            assert _ci_normal(cmd) in ci, f"{b.id}: .ci/run does not run {cmd!r}"
    return "\n".join(code) + "\n"


@dataclass(frozen=True)
class Ports:
    s3: int
    service: int
    gcs: int
    azurite: int = 10000


def substitute(code: str, ports: Ports) -> str:
    """Only the endpoints change (and a venv prefix the runner's PATH makes redundant)."""
    code = re.sub(r"(127\.0\.0\.1|localhost):9000\b", f"127.0.0.1:{ports.s3}", code)
    code = re.sub(r"moto_server -p 9000\b", f"moto_server -p {ports.s3}", code)
    code = re.sub(r"(127\.0\.0\.1|localhost):8080\b", f"127.0.0.1:{ports.service}", code)
    code = re.sub(r"--port 8080\b", f"--port {ports.service}", code)
    code = re.sub(r"(127\.0\.0\.1|localhost):4443\b", f"127.0.0.1:{ports.gcs}", code)
    code = re.sub(r"-port 4443\b", f"-port {ports.gcs}", code)
    code = re.sub(r"(127\.0\.0\.1|localhost):10000\b", f"127.0.0.1:{ports.azurite}", code)
    code = re.sub(r"--blobPort 10000\b", f"--blobPort {ports.azurite}", code)
    code = code.replace("start_http_server(9100)", "start_http_server(0)")
    code = ACTIVATE.sub("", code)
    return code.replace(".venv/bin/", "")


def fresh_buckets(ep: S3Endpoint, names: set[str]) -> None:
    """The page's buckets on the test run's moto server, created empty."""
    s3 = ep.boto3_client()
    for name in sorted(names):
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
            s3.create_bucket(Bucket=name)
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=name, Delete={"Objects": keys})


def run_page(source: Path, blocks: list[Block], work: Path, ep: S3Endpoint, spark: bool) -> str:
    own_s3 = any("moto_server" in b.code for b in blocks)
    ports = Ports(
        s3=free_port() if own_s3 else int(ep.endpoint.rsplit(":", 1)[1]),
        service=free_port(),
        gcs=free_port(),
        azurite=free_port(),
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AWS_")
        and k not in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS")
    }
    env.update(
        HOME=str(work),
        SPARK_LOCAL_IP="127.0.0.1",
        PATH=f"{Path(EXE).parent}{os.pathsep}{env['PATH']}",
    )
    if not own_s3:
        env.update(
            AWS_ACCESS_KEY_ID=ep.access_key_id,
            AWS_SECRET_ACCESS_KEY=ep.secret_access_key,
            AWS_REGION=ep.region,
        )
        fresh_buckets(ep, {m for b in blocks for m in S3_BUCKET.findall(b.code)})
    spec = []
    for b in blocks:
        if b.marker in NEVER_RUN or (b.marker == "needs-spark" and not spark):
            continue
        code = ci_part(b) if b.marker == "ci" else b.code
        spec.append(
            {
                "id": b.id,
                "lang": b.lang,
                "code": substitute(code, ports),
                "continues": b.marker == "continues",
            }
        )
    (work / "spec.json").write_text(json.dumps({"blocks": spec, "timeout": PAGE_TIMEOUT}))
    if source.parent.name == "examples":
        (work / "examples").symlink_to(ROOT / "examples")
    if any("node_modules/" in b.code for b in blocks):  # Azurite, as .ci/run installs it
        if not (ROOT / "node_modules" / ".bin" / "azurite-blob").exists():
            pytest.skip("Azurite not installed: npm install azurite@3.37.0 (see .ci/run)")
        (work / "node_modules").symlink_to(ROOT / "node_modules")
    p = subprocess.Popen(
        [sys.executable, str(RUNNER), str(work / "spec.json")],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=PAGE_TIMEOUT)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)  # the runner stops what the page started
        out, _ = p.communicate(timeout=60)
        raise AssertionError(
            f"{source.name} still running after {PAGE_TIMEOUT} s:\n{out}"
        ) from None
    assert p.returncode == 0, f"{source.name} failed:\n{out[-20000:]}"
    return out


CLEANS_UP = {"getting-started.md"}
"""Walk-throughs that end by removing everything they made (the others leave only
what .gitignore covers, and never a secret such as a bearer-token file)."""
HARNESS = {"spec.json", "examples", "node_modules"}


def leftovers(work: Path) -> list[str]:
    """What a page left in its working directory (directories with a trailing /)."""
    return sorted(
        p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
        for p in work.iterdir()
        if p.name not in HARNESS
    )


def gitignored(name: str, is_dir: bool) -> bool:
    """Whether the repository's .gitignore covers ``name`` at the checkout's root."""
    path = name.rstrip("/") + ("/" if is_dir else "")
    r = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--no-index", "-q", path], check=False
    )
    return r.returncode == 0


def _params() -> list[object]:
    out: list[object] = []
    for src in [*PAGES, *EXAMPLES]:
        blocks = [b for b in ALL if b.page == src]
        if not blocks:
            continue
        name = src.relative_to(ROOT).as_posix()
        if any(b.marker != "needs-spark" and b.marker not in NEVER_RUN for b in blocks):
            out.append(pytest.param(src, False, id=name))
        if any(b.marker == "needs-spark" for b in blocks):
            out.append(
                pytest.param(
                    src, True, id=f"{name}[spark]", marks=[pytest.mark.spark, pytest.mark.slow]
                )
            )
    return out


@pytest.mark.s3
@pytest.mark.parametrize(("source", "spark"), _params())
@pytest.mark.slow
def test_page_runs_as_written(
    source: Path, spark: bool, tmp_path: Path, s3_endpoint: S3Endpoint
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    blocks = [b for b in ALL if b.page == source]
    out = run_page(source, blocks, work, s3_endpoint, spark)
    ran = re.findall(r"^--- (\S+)", out, re.M)
    skipped = [
        f"{b.id} ({b.marker}: {b.reason})"
        for b in blocks
        if b.marker in NEVER_RUN or (b.marker == "needs-spark" and not spark)
    ]
    print(f"ran {ran}; not run here: {skipped}")
    assert ran
    assert "Traceback" not in out, f"{source.name} printed a traceback:\n{out[-5000:]}"
    left = leftovers(work)
    assert not [n for n in left if "token" in n], f"{source.name} leaves a secret: {left}"
    unignored = [n for n in left if not gitignored(n, (work / n.rstrip("/")).is_dir())]
    assert not unignored, f"{source.name} leaves {unignored}, which .gitignore does not cover"
    if source.name in CLEANS_UP:
        assert not left, f"{source.name} ends by removing what it made, but leaves {left}"
    if source.name == "subscribers.md":  # the work example does what its comments say
        for line in (
            "work: sequence 0: exit 0 -> acked",
            "work: sequence 1: exit 3: cannot do bad -> rejected",
            "work: 1 acked, 1 rejected",
            "exit 1",
            "  rejected 1 after 1 deliveries: exit 3: cannot do bad",
            "redriven (claimable again): 1",
        ):
            assert re.search(rf"^{re.escape(line)}", out, re.M), (line, out[-3000:])
    if source.name == "spark_stream_to_parquet.py":  # a long job shows its progress
        assert re.search(
            r"^batch \d+: \d+ rows \(total \d+\), up to sequence \d+, "
            r"lag \d+ entries.* -> \./out$",
            out,
            re.M,
        ), out[-3000:]
        assert re.search(r"^done: 1000 rows in \d+ micro-batches", out, re.M), out[-3000:]


def test_getting_started_is_walked_whole() -> None:
    """docs/getting-started.md: every block runs (Spark's in the Spark variant), and the
    page starts its own local S3."""
    page = [b for b in ALL if b.page.name == "getting-started.md"]
    assert len(page) >= 12
    assert not [b for b in page if b.marker in NEVER_RUN]
    assert any("moto_server" in b.code for b in page)


# --- pages in reading order, on one store ------------------------------------------------

WALKS = {
    "README.md then docs/spark.md": (ROOT / "README.md", ROOT / "docs" / "spark.md"),
    "README.md then docs/subscribers.md": (ROOT / "README.md", ROOT / "docs" / "subscribers.md"),
}
"""Pages a reader follows one after the other on the same URL (``s3://bucket/prefix``),
in one working directory and one S3: what the first leaves behind (entries consumed and
dequeued, a stage, subscribers) is what the second meets."""


@pytest.mark.s3
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("walk", sorted(WALKS))
def test_pages_run_one_after_the_other_on_one_store(
    walk: str, tmp_path: Path, s3_endpoint: S3Endpoint
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    blocks = [b for page in WALKS[walk] for b in ALL if b.page == page]
    out = run_page(WALKS[walk][-1], blocks, work, s3_endpoint, spark=True)
    assert "Traceback" not in out, out[-5000:]
