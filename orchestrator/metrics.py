"""Prometheus metrics of one service instance (its own registry, so several instances can share a process).

Counted as they happen: request latency by method, route template and status; validation lag (announce to
verdict) of every judged batch. Read from the state at each scrape: nodes by role and state, work by state,
batches by status, the policy version, the work in the async window and its capacity, and how long the oldest
batch has waited for a validator.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select

from orchestrator.db import SUBMITTED, Work

if TYPE_CHECKING:
    from orchestrator.service import Orchestrator

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LAG_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600)


class _StateCollector:
    def __init__(self, service: Orchestrator):
        self.service = service

    def collect(self):
        svc = self.service
        nodes = GaugeMetricFamily(
            "orchestrator_nodes", "Nodes by role and state (banned nodes as state=banned)", labels=["role", "state"]
        )
        states = Counter(("banned" if n.banned else n.state, n.role) for n in svc.registry.live.values())
        for role in ("worker", "validator"):
            for state in ("pending", "healthy", "unhealthy", "dead", "banned"):
                nodes.add_metric([role, state], states[(state, role)])
        yield nodes
        now = svc.clock()
        with svc.db() as s:
            by_state = dict(s.execute(select(Work.state, func.count()).group_by(Work.state)).all())
            claimed = s.scalar(
                select(func.count())
                .select_from(Work)
                .where(Work.state == SUBMITTED, Work.claimed_by.is_not(None), Work.lease_expires > now)
            )
            oldest = s.scalar(select(func.min(Work.announced_at)).where(Work.state == SUBMITTED))
        work = GaugeMetricFamily("orchestrator_assignments", "Assignments by state", labels=["state"])
        for state in ("open", "submitted", "accepted", "rejected", "lost", "expired"):
            work.add_metric([state], by_state.get(state, 0))
        yield work
        batches = GaugeMetricFamily("orchestrator_batches", "Announced batches by status", labels=["status"])
        pending = by_state.get(SUBMITTED, 0)
        for status, count in (
            ("submitted", pending - claimed),
            ("validating", claimed),
            ("accepted", by_state.get("accepted", 0)),
            ("rejected", by_state.get("rejected", 0)),
        ):
            batches.add_metric([status], count)
        yield batches
        yield GaugeMetricFamily(
            "orchestrator_policy_version", "Current policy version", value=svc.scheduler.policy.version
        )
        yield GaugeMetricFamily(
            "orchestrator_window_work",
            "Work in the async window (open, submitted, accepted and unread)",
            value=svc.scheduler.window_work(),
        )
        yield GaugeMetricFamily(
            "orchestrator_window_capacity", "Most work the async window holds", value=svc.scheduler.capacity
        )
        yield GaugeMetricFamily(
            "orchestrator_oldest_unvalidated_seconds",
            "Age of the oldest batch without a verdict (0: none)",
            value=max(0.0, now - oldest) if oldest is not None else 0.0,
        )


class Metrics:
    def __init__(self, service: Orchestrator):
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "orchestrator_request_seconds",
            "Request latency",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.validation_lag = Histogram(
            "orchestrator_validation_lag_seconds",
            "Seconds from a batch's announcement to its verdict",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StateCollector(service))
        self._children: dict[tuple[str, str, int], Histogram] = {}  # labels() takes a lock and builds a key

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """One request's latency under its route template."""
        labels = (method, route, status)
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self.latency.labels(method, route, str(status))
        child.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def middleware(self, app: Callable) -> Callable:
        """ASGI middleware observing each HTTP request's latency under its route template."""
        observe_one = self.observe

        async def observe(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            status = [500]

            async def send_status(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            start = time.perf_counter()
            try:
                await app(scope, receive, send_status)
            finally:
                observe_one(
                    scope["method"],
                    getattr(scope.get("route"), "path", "unmatched"),
                    status[0],
                    time.perf_counter() - start,
                )

        return observe
