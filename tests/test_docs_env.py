"""docs/operations.md lists every environment variable tieredbuf reads."""

from __future__ import annotations

import re
from pathlib import Path

from tieredbuf.config import AZURE_OPTION_ENV, S3_CREDENTIAL_ENV, S3_OPTION_ENV
from tieredbuf.service.tokens import TOKENS_ENV
from tieredbuf.store.gcs_open import CREDENTIALS_ENV, EMULATOR_ENV

ROOT = Path(__file__).resolve().parent.parent
READS = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["']([A-Z][A-Z0-9_]+)["']""")


def _read_by_the_code() -> set[str]:
    names = {
        e for table in (S3_OPTION_ENV, AZURE_OPTION_ENV) for envs in table.values() for e in envs
    }
    names |= set(S3_CREDENTIAL_ENV) | {TOKENS_ENV, EMULATOR_ENV, CREDENTIALS_ENV}
    for path in [*(ROOT / "tieredbuf").rglob("*.py"), ROOT / "tests" / "conftest.py"]:
        names |= set(READS.findall(path.read_text("utf-8")))
    return names


def test_every_environment_variable_is_documented() -> None:
    doc = (ROOT / "docs" / "operations.md").read_text("utf-8")
    section = doc.split("## Environment variables", 1)[1]
    names = _read_by_the_code()
    assert {
        "TIEREDBUF_LOG_LEVEL",
        "AWS_ENDPOINT_URL",
        "AWS_ALLOW_HTTP",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "TIEREDBUF_AZURITE_BLOB",
    } <= names
    missing = sorted(n for n in names if f"`{n}`" not in section)
    assert not missing, f"docs/operations.md, Environment variables, lacks {missing}"
