"""The contribution ledger: per node, what it got credited for and what was refused, from the work records.

Credit comes from validators only: accepted samples are the number of rewards the validator recomputed and
accepted tokens the validator's own count, never the worker's claims. Each rejected batch counts once under
each failed check it names (or under its reason when it names none); assignments that passed their deadline
count as expired, and those the node gave up by leaving the pool (or held when it was banned) as lost. Each
expired or lost assignment is a strike against the node, like a rejected batch.

The ledger is paged by node key (`after`, `limit`): a page reads only its nodes' rows, so it costs the same in a
pool of 100,000 nodes as in one of 100.
"""

from __future__ import annotations

import csv
import io
from collections import Counter, defaultdict

from sqlalchemy import func, select, true
from sqlalchemy.orm import Session

from bridge.protocol.messages import Ledger, LedgerEntry
from orchestrator.db import ACCEPTED, REJECTED, Node, Work
from orchestrator.nodes import NodeRegistry

CSV_COLUMNS = (
    "node_key",
    "role",
    "accepted_batches",
    "accepted_samples",
    "accepted_tokens",
    "rejected_batches",
    "rejection_reasons",
    "expired_assignments",
    "lost_assignments",
    "first_seen",
    "last_seen",
    "banned",
    "near_tie_cost",
    "near_tie_tokens",
)


def build_ledger(
    s: Session, registry: NodeRegistry, now: float, after: str | None = None, limit: int | None = None
) -> Ledger:
    """The ledger of the nodes after the key `after` (None: from the first), at most `limit` (None: all), in key
    order; `next_after` is the last key listed when more may follow."""
    query = select(Node).order_by(Node.key)
    if after is not None:
        query = query.where(Node.key > after)
    nodes = list(s.scalars(query if limit is None else query.limit(limit)))
    keys = [n.key for n in nodes]
    mine = Work.node_key.in_(keys) if limit is not None or after is not None else true()
    accepted = (
        {
            key: (batches, samples or 0, tokens or 0, cost or 0.0, judged or 0)
            for key, batches, samples, tokens, cost, judged in s.execute(
                select(
                    Work.node_key,
                    func.count(),
                    func.sum(Work.num_samples),
                    func.sum(Work.verified_tokens),
                    func.sum(Work.near_tie_cost),
                    func.sum(Work.near_tie_tokens),
                )
                .where(Work.state == ACCEPTED, mine)
                .group_by(Work.node_key)
            )
        }
        if keys
        else {}
    )
    reasons: dict[str, Counter] = defaultdict(Counter)
    rejected: Counter = Counter()
    for key, checks, reason in (
        s.execute(select(Work.node_key, Work.failed_checks, Work.reason).where(Work.state == REJECTED, mine))
        if keys
        else ()
    ):
        rejected[key] += 1
        reasons[key].update(checks or [reason or "unspecified"])
    expired, lost = (
        dict(
            s.execute(select(Work.node_key, func.count()).where(when.is_not(None), mine).group_by(Work.node_key)).all()
        )
        if keys
        else {}
        for when in (Work.expired_at, Work.abandoned_at)
    )
    entries = []
    for node in nodes:
        batches, samples, tokens, cost, judged = accepted.get(node.key, (0, 0, 0, 0.0, 0))
        live = registry.live.get(node.key)
        entries.append(
            LedgerEntry(
                node_key=node.key,
                role=node.role,
                accepted_batches=batches,
                accepted_samples=samples,
                accepted_tokens=tokens,
                rejected_batches=rejected[node.key],
                rejection_reasons=dict(reasons[node.key]),
                expired_assignments=expired.get(node.key, 0),
                lost_assignments=lost.get(node.key, 0),
                first_seen=node.first_seen,
                last_seen=live.last_seen if live else node.last_seen,
                banned=node.banned,
                near_tie_cost=cost,
                near_tie_tokens=judged,
            )
        )
    more = limit is not None and len(nodes) == limit
    return Ledger(entries=entries, generated_at=now, next_after=keys[-1] if more else None)


def ledger_csv(ledger: Ledger) -> str:
    """One row per node; rejection_reasons as `check=count` pairs joined by ';'."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for e in ledger.entries:
        reasons = ";".join(f"{k}={v}" for k, v in sorted(e.rejection_reasons.items()))
        writer.writerow(
            [
                e.node_key,
                e.role,
                e.accepted_batches,
                e.accepted_samples,
                e.accepted_tokens,
                e.rejected_batches,
                reasons,
                e.expired_assignments,
                e.lost_assignments,
                f"{e.first_seen:.3f}",
                f"{e.last_seen:.3f}",
                str(e.banned).lower(),
                f"{e.near_tie_cost:.4f}",
                e.near_tie_tokens,
            ]
        )
    return out.getvalue()
