"""The coordination service (DESIGN section 8), started with `intellect orchestrator CONFIG`.

`app` the FastAPI routes, `db` storage and schema versions, `durability` group commit for SQLite, `auth` signed
requests, the admin token and rate limits, `nodes` admission, liveness and bans, `scheduler` assignments, pacing,
claims and verdicts, `ledger` contributions, `metrics` Prometheus, `dashboard` the HTML page, `process` the service
as a child process, `cli` the command. The wire models and the client live in `bridge.protocol`.
"""
