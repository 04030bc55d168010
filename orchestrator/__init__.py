"""The coordination service, started with `intellect orchestrator CONFIG` (intellect/orchestrator_cli.py).

`config` its config section, `service` the state of one instance and what the hot node routes do, `app` the
FastAPI routes, `fast_lane` the hot node routes' table and the lane that answers them, `db` storage and schema
versions, `durability` group commit for SQLite, `auth` signed requests, replays across restarts, the admin
token and rate limits, `nodes` admission, liveness and bans, `scheduler` assignments, deadlines, pacing, claims
and verdicts, `ledger` contributions, `metrics` Prometheus, `dashboard` the HTML page, `guards` strict JSON,
422s that never echo and bounded log records, `server` uvicorn with connection limits and the hot routes
answered from its parser, `rollback` forgets the records past a learner step. The wire models and the client
live in `bridge.protocol`; among the project's packages this one imports only `bridge`.
"""
