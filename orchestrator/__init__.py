"""The coordination service (docs/design.md section 8), started with `intellect orchestrator CONFIG`.

`app` the FastAPI routes, `fast_lane` the hot node routes' table and their lane in front of FastAPI, `db` storage
and schema versions, `durability` group commit for SQLite, `auth` signed requests, replays across restarts, the
admin token and rate limits, `nodes` admission, liveness and bans, `scheduler` assignments, deadlines, pacing,
claims and verdicts, `ledger` contributions, `metrics` Prometheus, `dashboard` the HTML page, `guards` strict
JSON, 422s that never echo and bounded log records, `server` uvicorn with connection limits, `process` the
service as a child process, `cli` the command. The wire models and the client live in `bridge.protocol`.
"""
