"""Roll a pool's records back to an earlier policy version, offline (the service stopped).

When a learner is restored from a checkpoint at step s after it had already published versions above s, those
versions are gone for good: the restored learner will publish different weights under the same numbers. So,
before the pool starts again, `rollback(url, s)` forgets the policy announcements above s and marks the work
still open or awaiting validation at those versions `lost` (its weights no longer exist, so it can neither be
validated nor be the worker's fault). Accepted batches stay accepted and credited in the ledger; the learner
skips them as coming from a policy ahead of its step. `intellect run --resume` calls it, together with deleting
the stale version directories of the learner, the relays and the nodes under the run directory.
"""

from __future__ import annotations

import time

from sqlalchemy import delete, update
from sqlalchemy.orm import sessionmaker

from orchestrator.db import LOST, OPEN, SUBMITTED, Policy, Work, open_database


def rollback(database_url: str, version: int) -> dict[str, int]:
    """Forget policy versions above `version`; their open and submitted work becomes lost. Returns counts."""
    engine = open_database(database_url)
    try:
        with sessionmaker(engine).begin() as s:
            policies = s.execute(delete(Policy).where(Policy.version > version)).rowcount
            lost = s.execute(
                update(Work)
                .where(Work.version > version, Work.state.in_((OPEN, SUBMITTED)))
                .values(state=LOST, lost_at=time.time())
            ).rowcount
    finally:
        engine.dispose()
    return {"policies_forgotten": policies, "work_lost": lost}
