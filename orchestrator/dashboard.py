"""The operator's dashboard at `/`: one self-contained HTML page (inline CSS, no scripts or external assets)
that reloads itself every few seconds. Every value has an element id, so tests and scrapers can read it.

The totals count every node (one pass over the registry in memory) and every assignment (SQL aggregates); the
node and ledger tables show one page of nodes in key order, with a link to the next, so the page costs about
the same at 100,000 nodes as at 100 (the service also reuses it for orchestrator.public_cache_s)."""

from __future__ import annotations

import datetime
import html
import urllib.parse
from collections import Counter
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from bridge.protocol.messages import Ledger, NodeInfo, PolicyInfo
from orchestrator.db import ACCEPTED, REJECTED, SUBMITTED, Work

if TYPE_CHECKING:
    from orchestrator.service import Orchestrator

REFRESH_S = 5
_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1d2733;background:#f6f7f9}
h1{font-size:1.4rem;margin:0 0 .2rem}h2{font-size:1.05rem;margin:1.4rem 0 .4rem}
.sub{color:#5b6675;margin-bottom:1rem}
.cards{display:flex;flex-wrap:wrap;gap:.8rem}
.card{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:.6rem .9rem;min-width:9rem}
.card .v{font-size:1.5rem;font-weight:600}.card .k{color:#5b6675;font-size:.8rem}
table{border-collapse:collapse;background:#fff;font-size:.85rem}
th,td{border:1px solid #dde1e6;padding:.25rem .5rem;text-align:left}th{background:#eef0f3}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.healthy{color:#1a7f37}.unhealthy{color:#9a6700}.dead,.banned{color:#cf222e}.pending{color:#5b6675}
code{font-size:.8rem}
"""


def _e(value: object) -> str:
    return html.escape(str(value))


def _ago(now: float, then: float | None) -> str:
    return "never" if then is None else f"{max(0.0, now - then):.0f} s ago"


def _card(ident: str, label: str, value: object) -> str:
    return f'<div class="card"><div class="v" id="{ident}">{_e(value)}</div><div class="k">{_e(label)}</div></div>'


def _throughput(svc: Orchestrator, now: float, window_s: float) -> tuple[int, int]:
    with svc.db() as s:
        samples, tokens = s.execute(
            select(func.sum(Work.num_samples), func.sum(Work.verified_tokens)).where(
                Work.state == ACCEPTED, Work.verdict_at > now - window_s
            )
        ).one()
    return samples or 0, tokens or 0


def render(
    svc: Orchestrator,
    policy: PolicyInfo,
    nodes: list[NodeInfo],
    ledger: Ledger,
    after: str | None = None,
    next_after: str | None = None,
) -> str:
    """The page: totals over the whole pool, `nodes` and `ledger` (one page of each, after the key `after`) in
    the tables, and a link to the page after `next_after` when there is one."""
    now = svc.clock()
    with svc.db() as s:
        counts = dict(s.execute(select(Work.state, func.count()).group_by(Work.state)).all())
    samples_min, tokens_min = _throughput(svc, now, 60)
    samples_10, tokens_10 = _throughput(svc, now, 600)
    state_of = {n.key: ("banned" if n.banned else n.state) for n in nodes}
    by_state = Counter("banned" if n.banned else n.state for n in list(svc.registry.live.values()))
    cards = "".join(
        [
            _card("policy-version", "policy version", policy.version),
            _card("learner-step", "learner step", policy.learner_step),
            _card("window", "async window (versions)", f"{policy.min_version}-{policy.version}"),
            _card("nodes-healthy", "healthy nodes", by_state["healthy"]),
            _card("nodes-unhealthy", "unhealthy nodes", by_state["unhealthy"]),
            _card("nodes-dead", "dead nodes", by_state["dead"]),
            _card("nodes-banned", "banned nodes", by_state["banned"]),
            _card("samples-per-min", "accepted samples / min", samples_min),
            _card("tokens-per-min", "accepted tokens / min", tokens_min),
            _card("samples-10min", "accepted samples, last 10 min", samples_10),
            _card("tokens-10min", "accepted tokens, last 10 min", tokens_10),
            _card("batches-pending", "batches awaiting a verdict", counts.get(SUBMITTED, 0)),
            _card("batches-accepted", "batches accepted", counts.get(ACCEPTED, 0)),
            _card("batches-rejected", "batches rejected", counts.get(REJECTED, 0)),
            _card("assignments-expired", "assignments expired", svc.scheduler.expired_total),
            _card("assignments-lost", "assignments lost (abandoned)", svc.scheduler.lost_total),
        ]
    )
    node_rows = "".join(
        f'<tr id="node-{n.key}"><td><code title="{n.key}">{n.key[:16]}</code></td><td>{n.role}</td>'
        f'<td class="{state_of[n.key]}">{state_of[n.key]}</td><td>{_ago(now, n.last_seen)}</td>'
        f'<td class="n">{n.open_assignments}</td><td>{_e(n.ban_reason or "")}</td></tr>'
        for n in nodes
    )
    ledger_rows = "".join(
        f'<tr id="ledger-{e.node_key}"><td><code title="{e.node_key}">{e.node_key[:16]}</code></td><td>{e.role}</td>'
        f'<td class="n">{e.accepted_batches}</td><td class="n">{e.accepted_samples}</td>'
        f'<td class="n">{e.accepted_tokens}</td><td class="n">{e.rejected_batches}</td>'
        f"<td>{_e(', '.join(f'{k}: {v}' for k, v in sorted(e.rejection_reasons.items())))}</td>"
        f'<td class="n">{e.lost_assignments}</td><td class="n">{e.expired_assignments}</td></tr>'
        for e in ledger.entries
    )
    pages = '<a id="first-page" href="/">first page</a>' if after else ""
    if next_after:
        pages += f' <a id="next-page" href="/?after={urllib.parse.quote(next_after)}">next page</a>'
    shown = (
        f"{len(nodes)} of {len(svc.registry.live)} nodes, in key order"
        + (f", after {_e(after[:16])}..." if after else "")
        + f" {pages}"
    )
    stamp = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    relays = ", ".join(policy.relays) or "none"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>{_e(svc.run_name)} - orchestrator</title><style>{_CSS}</style></head>
<body>
<h1 id="run-name">{_e(svc.run_name)}</h1>
<div class="sub">orchestrator at {stamp}; relays: <span id="relays">{_e(relays)}</span>;
refreshes every {REFRESH_S} s</div>
<div class="cards">{cards}</div>
<h2>Nodes</h2>
<div class="sub" id="page">{shown}</div>
<table id="nodes"><thead><tr><th>key</th><th>role</th><th>state</th><th>last heartbeat</th><th>open work</th>
<th>ban reason</th></tr></thead><tbody>{node_rows}</tbody></table>
<h2>Ledger</h2>
<table id="ledger"><thead><tr><th>node</th><th>role</th><th>accepted batches</th><th>accepted samples</th>
<th>accepted tokens</th><th>rejected batches</th><th>rejections</th><th>lost assignments</th>
<th>expired assignments</th></tr></thead>
<tbody>{ledger_rows}</tbody></table>
</body></html>
"""
