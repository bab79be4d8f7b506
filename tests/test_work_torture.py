"""The work-queue torture test in the slow suite (I9, I10): worker processes under
random SIGKILL and SIGSTOP, injected data GET faults and lost CAS responses, checked
against invariants (tests/work_torture.py says which, and how to run it longer)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.work_torture import run

SEED = int(os.environ.get("TB_TORTURE_SEED", "7"))
KILLS = int(os.environ.get("TB_TORTURE_KILLS", "25"))


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("max_deliveries", [1, 2, None])
def test_I9_I10_work_queue_under_kills_stalls_get_faults_and_lost_responses(
    tmp_path: Path, max_deliveries: int | None
) -> None:
    rep = run(tmp_path, seed=SEED, kills=KILLS, max_deliveries=max_deliveries)
    print(rep.summary())  # the counts, for the record (pytest -s)
    assert rep.violations == {}, (
        rep.summary() + "\n" + "\n".join(f"{k}: {v[:5]}" for k, v in rep.violations.items())
    )
    assert rep.kills >= KILLS and rep.returns >= rep.entries
    assert rep.get_faults > 0 and rep.lost_responses > 0  # the chaos really happened
    if max_deliveries is None:
        assert rep.rejected == 0
