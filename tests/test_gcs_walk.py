"""docs/operations.md, "Google Cloud Storage": a newcomer's walk, as written, produces and
consumes a record on fake-gcs-server (the emulator the page starts itself).  The whole
page also runs in tests/test_docs_snippets.py; this runs the section alone and checks
what it printed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.endpoint import S3Endpoint
from tests.test_docs_snippets import ROOT, page_blocks, run_page

PAGE = ROOT / "docs" / "operations.md"


def _section() -> list:  # type: ignore[type-arg]
    text = PAGE.read_text("utf-8").splitlines()
    start = text.index("### Google Cloud Storage") + 1
    end = next(i for i in range(start, len(text)) if text[i].startswith("## "))
    return [b for b in page_blocks(PAGE) if start < b.line <= end]


def test_the_walk_starts_the_emulator_and_uses_the_cli_as_a_newcomer_would() -> None:
    blocks = _section()
    code = "".join(b.code for b in blocks)
    assert "STORAGE_EMULATOR_HOST" in code and "tieredbuf produce gs://" in code
    assert "tieredbuf consume gs://" in code and "fake-gcs-server" in code


@pytest.mark.gcs
@pytest.mark.s3
@pytest.mark.slow
def test_the_gcs_walk_produces_and_consumes_a_record_on_the_emulator(
    tmp_path: Path, s3_endpoint: S3Endpoint
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = run_page(PAGE, _section(), work, s3_endpoint, spark=False)
    assert "produced 1 record in 1 call -> sequences 0..0" in out, out
    assert "\nhello, gcs\n" in f"\n{out}", out
    assert "consumed 1 batch, 1 record; acked through sequence 0" in out, out
