"""The orchestrator's storage: SQLAlchemy models, and opening a database with its schema version checked.

SQLite (the default, a file in the run directory) runs in WAL mode with `synchronous=NORMAL`: a committed
transaction survives a crash of the process at once, and the service answers a request that wrote only after
an fsync of the WAL (group commit, `orchestrator/durability.py`), so an acknowledged record also survives a
crash of the machine. PostgreSQL works through a URL (`postgresql+psycopg://user@host/db`, with a driver
installed); it makes its own commits durable.

One table holds the work: an assignment row gets its batch's fields when the worker announces the batch
(a batch is the output of exactly one assignment, docs/design.md section 6), and the verdict's when a validator judges
it. Its `state` is the life of that work:

    open --announce (before its deadline)--> submitted --verdict--> accepted | rejected
    open --the node left the pool or was banned--> lost
    open --its deadline passed--> expired

Lost and expired are final: a batch announced for them is refused (scheduler.py), so a worker cannot hold
assignments back and announce only those it likes. A node that goes silent keeps its open assignments (they
expire at their deadline); `abandoned_at` marks an assignment its node gave up by leaving (or held when it was
banned), `expired_at` one whose deadline passed: each is a strike against the node, like a rejected batch. A
`lost_at` without `abandoned_at` is work a rollback (rollback.py) took back, no fault of the node.

`service_runs` records each start and clean stop of the service, and `nonces` the nonces a clean stop left
unexpired (auth.py: a restart does not reopen old signatures). `policy.manifest_sha256` is what the learner
announced for a version (SHARDCAST clients accept no other manifest for it). `service_secrets` holds the
service's own secrets by name: `assignment` salts every assignment's draws (`bridge.assignment`), made once
when the database is made (or upgraded) and kept, so the draws survive restarts.
`assignments.salt` is the salt of an assignment's draws, derived from that secret when it is issued (NULL for
one issued before schema 8: its draws were unsalted), and `assignments.logprobs_sha256` the digest of the
logprobs the validator wrote beside an accepted batch; `assignments.near_tie_samples` (schema 9) lists the samples
of an accepted batch whose replay took a near tie, which the learner leaves out by default.
`policy.curriculum_level` (schema 10) is the curriculum level the service decided for a version, and
`assignments.level` the level an assignment was issued at (its prompts' task slice, `bridge.curriculum`); both 0
without a curriculum and for rows written before.

Schema versions: `schema_info` holds the version this database was written with. `open_database` creates a
new database, upgrades an older one through `MIGRATIONS` (one function per step, in one transaction), and
refuses, with a message saying what to do, a database it cannot upgrade or one written by a newer release.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Connection,
    Engine,
    Executable,
    Float,
    ForeignKey,
    Index,
    Insert,
    Integer,
    String,
    Text,
    UniqueConstraint,
    Update,
    create_engine,
    event,
    inspect,
    select,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 10
# MIGRATIONS[v] upgrades a database at schema version v to v + 1 (in the transaction `open_database` holds).
MIGRATIONS: dict[int, Callable[[Connection], None]] = {}

OPEN, SUBMITTED, ACCEPTED, REJECTED, LOST, EXPIRED = "open", "submitted", "accepted", "rejected", "lost", "expired"


class SchemaError(RuntimeError):
    """A database this release cannot use as it is; the message says why and what to do."""


class Base(DeclarativeBase):
    pass


class SchemaInfo(Base):
    __tablename__ = "schema_info"

    version: Mapped[int] = mapped_column(Integer, primary_key=True)


class Node(Base):
    __tablename__ = "nodes"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))  # pending (challenge unanswered), healthy, unhealthy, dead
    banned: Mapped[bool] = mapped_column(Boolean, default=False)
    ban_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    banned_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    hardware: Mapped[dict] = mapped_column(JSON)
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
    challenge_seed: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    challenge_expires: Mapped[float | None] = mapped_column(Float, nullable=True)


class Policy(Base):
    __tablename__ = "policy"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    learner_step: Mapped[int] = mapped_column(Integer)
    relays: Mapped[list] = mapped_column(JSON)
    announced_at: Mapped[float] = mapped_column(Float)
    manifest_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)  # pinned by SHARDCAST clients
    curriculum_level: Mapped[int] = mapped_column(Integer, server_default="0")


class Work(Base):
    """An assignment and, once announced, its batch and verdict."""

    __tablename__ = "assignments"
    __table_args__ = (
        UniqueConstraint("node_key", "version", "k"),
        Index("ix_work_state_version", "state", "version"),
        Index("ix_work_node_state", "node_key", "state"),
        Index("ix_work_verdict_at", "verdict_at"),  # the dashboard's throughput of recent minutes
        # A validator's claim: the batch it holds, else the oldest unclaimed, found without reading or sorting
        # the whole backlog of submitted batches (a claim cost grew with the backlog before these).
        Index("ix_work_claim_queue", "state", "announced_at", "id"),
        Index("ix_work_claimed_by", "claimed_by", "state"),
        # The listing of decided batches after a cursor (the learner's poll), read in order without a sort.
        Index("ix_work_state_seq", "state", "verdict_seq"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_key: Mapped[str] = mapped_column(String(64), ForeignKey("nodes.key"))
    version: Mapped[int] = mapped_column(Integer)
    k: Mapped[int] = mapped_column(Integer)  # the node's k-th assignment at this version (docs/design.md section 8)
    salt: Mapped[str | None] = mapped_column(String(64), nullable=True)  # of its draws (None: issued unsalted)
    prompts: Mapped[int] = mapped_column(Integer)
    samples_per_prompt: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    issued_at: Mapped[float] = mapped_column(Float)
    lost_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    expired_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # its deadline passed while open
    abandoned_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # given up by its node: a strike
    # The batch, from the worker's announcement.
    batch_id: Mapped[str | None] = mapped_column(String(128), unique=True, nullable=True)
    store_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    num_samples: Mapped[int | None] = mapped_column(Integer, nullable=True)
    num_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    announced_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Validation.
    claimed_by: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_expires: Mapped[float | None] = mapped_column(Float, nullable=True)
    validator_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    verdict_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    verdict_seq: Mapped[int | None] = mapped_column(Integer, unique=True, nullable=True)
    failed_checks: Mapped[list | None] = mapped_column(JSON, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    rewards: Mapped[list | None] = mapped_column(JSON, nullable=True)
    verified_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    near_tie_cost: Mapped[float | None] = mapped_column(Float, nullable=True)  # the worker's near-tie ledger
    near_tie_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    logprobs_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the validator's logprobs
    near_tie_samples: Mapped[list | None] = mapped_column(JSON, nullable=True)  # the learner leaves them out
    level: Mapped[int] = mapped_column(Integer, server_default="0")  # curriculum level of its prompts
    delivered_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # read by the learner


class ServiceRun(Base):
    """One start of the service; `stopped_at` is set by a clean stop (None: running, or it crashed)."""

    __tablename__ = "service_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    started_at: Mapped[float] = mapped_column(Float)
    stopped_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class ServiceSecret(Base):
    """A secret of the service's own, by name (never sent whole to anyone; see the module docstring)."""

    __tablename__ = "service_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))


ASSIGNMENT_SECRET = "assignment"


def _new_secrets(conn: Connection) -> None:
    """The service's secrets, made once (a database that has one keeps it)."""
    have = set(conn.execute(select(ServiceSecret.name)).scalars())
    if ASSIGNMENT_SECRET not in have:
        conn.execute(ServiceSecret.__table__.insert().values(name=ASSIGNMENT_SECRET, value=secrets.token_hex(32)))


def service_secret(conn: Connection, name: str) -> bytes:
    """The named secret's bytes; SchemaError when the database has none (it was not made by open_database)."""
    value = conn.execute(select(ServiceSecret.value).where(ServiceSecret.name == name)).scalar_one_or_none()
    if value is None:
        raise SchemaError(f"the database holds no {name!r} secret: open it with orchestrator.db.open_database")
    return bytes.fromhex(value)


class SeenNonce(Base):
    """A nonce the last clean stop left unexpired, reloaded at the next start."""

    __tablename__ = "nonces"

    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires: Mapped[float] = mapped_column(Float)


def _v1_to_v2(conn: Connection) -> None:
    """Assignment deadlines (`expired_at`) and the replay guard's tables. A version-1 service kept its nonces in
    memory only, so its last run counts as an unclean stop (auth.py)."""
    conn.execute(text("ALTER TABLE assignments ADD COLUMN expired_at FLOAT"))
    conn.execute(text("CREATE INDEX ix_work_verdict_at ON assignments (verdict_at)"))
    for table in (ServiceRun.__table__, SeenNonce.__table__):
        table.create(conn)
    conn.execute(ServiceRun.__table__.insert().values(started_at=0.0, stopped_at=None))


MIGRATIONS[1] = _v1_to_v2


def _v2_to_v3(conn: Connection) -> None:
    """Each policy version's manifest sha256 as the learner announced it (SHARDCAST clients pin it)."""
    conn.execute(text("ALTER TABLE policy ADD COLUMN manifest_sha256 VARCHAR(64)"))


MIGRATIONS[2] = _v2_to_v3


def _v3_to_v4(conn: Connection) -> None:
    """The claim queue's indexes (`Work`); a database that has them already keeps them."""
    for index in Work.__table__.indexes:
        if index.name in ("ix_work_claim_queue", "ix_work_claimed_by"):
            index.create(conn, checkfirst=True)


MIGRATIONS[3] = _v3_to_v4


def _v4_to_v5(conn: Connection) -> None:
    """The listing's index of decided batches in verdict order (`Work`)."""
    for index in Work.__table__.indexes:
        if index.name == "ix_work_state_seq":
            index.create(conn, checkfirst=True)


MIGRATIONS[4] = _v4_to_v5


def _v5_to_v6(conn: Connection) -> None:
    """`abandoned_at`: assignments a node gave up by leaving the pool (a strike). The lost work of earlier
    versions stays without it: it was no strike when it was lost. A database that has the column keeps it."""
    if "abandoned_at" not in {c["name"] for c in inspect(conn).get_columns(Work.__tablename__)}:
        conn.execute(text("ALTER TABLE assignments ADD COLUMN abandoned_at FLOAT"))


MIGRATIONS[5] = _v5_to_v6


def _v6_to_v7(conn: Connection) -> None:
    """`near_tie_cost` and `near_tie_tokens`: the validator's near-tie numbers of a judged batch (the worker's
    near-tie ledger). Batches judged before have neither and count as spending nothing."""
    names = {c["name"] for c in inspect(conn).get_columns(Work.__tablename__)}
    for column, kind in (("near_tie_cost", "FLOAT"), ("near_tie_tokens", "BIGINT")):
        if column not in names:
            conn.execute(text(f"ALTER TABLE assignments ADD COLUMN {column} {kind}"))


MIGRATIONS[6] = _v6_to_v7


def _v7_to_v8(conn: Connection) -> None:
    """The service's secrets, `salt` (of each assignment's draws, `bridge.assignment`; assignments issued before
    keep NULL, their draws unsalted as they were handed out) and `logprobs_sha256` (the validator's logprobs of
    an accepted batch; batches judged before have none)."""
    ServiceSecret.__table__.create(conn, checkfirst=True)
    _new_secrets(conn)
    names = {c["name"] for c in inspect(conn).get_columns(Work.__tablename__)}
    for column in ("salt", "logprobs_sha256"):
        if column not in names:
            conn.execute(text(f"ALTER TABLE assignments ADD COLUMN {column} VARCHAR(64)"))


MIGRATIONS[7] = _v7_to_v8


def _v8_to_v9(conn: Connection) -> None:
    """`near_tie_samples`: the samples of an accepted batch whose replay took a near tie (batches judged before
    have none: NULL, read as no sample)."""
    names = {c["name"] for c in inspect(conn).get_columns(Work.__tablename__)}
    if "near_tie_samples" not in names:
        conn.execute(text("ALTER TABLE assignments ADD COLUMN near_tie_samples JSON"))


MIGRATIONS[8] = _v8_to_v9


def _v9_to_v10(conn: Connection) -> None:
    """`policy.curriculum_level` and `assignments.level` (`bridge.curriculum`): 0 for what was written before."""
    for table, column in (("policy", "curriculum_level"), (Work.__tablename__, "level")):
        if column not in {c["name"] for c in inspect(conn).get_columns(table)}:
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0"))


MIGRATIONS[9] = _v9_to_v10


def sqlite_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path).absolute()}"


def _sqlite_pragmas(dbapi_connection, _record, autocheckpoint: bool = True) -> None:
    cursor = dbapi_connection.cursor()
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON", "busy_timeout=10000"):
        cursor.execute(f"PRAGMA {pragma}")
    if not autocheckpoint:
        cursor.execute("PRAGMA wal_autocheckpoint=0")
    cursor.close()


def open_database(
    url: str, migrations: Mapping[int, Callable[[Connection], None]] = MIGRATIONS, *, autocheckpoint: bool = True
) -> Engine:
    """An engine on `url` whose schema is at SCHEMA_VERSION: created if the database is empty, upgraded with
    `migrations` if older; raises SchemaError if it cannot be used. SQLite with `autocheckpoint=False`: no
    commit copies the WAL back into the database file (the service does that off its event loop, see
    durability.py)."""
    engine = create_engine(url)
    shown = engine.url.render_as_string(hide_password=True)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", functools.partial(_sqlite_pragmas, autocheckpoint=autocheckpoint))
    with engine.begin() as conn:
        tables = set(inspect(conn).get_table_names())
        if not tables:
            Base.metadata.create_all(conn)
            conn.execute(SchemaInfo.__table__.insert().values(version=SCHEMA_VERSION))
            _new_secrets(conn)
            return engine
        if SchemaInfo.__tablename__ not in tables:
            engine.dispose()
            raise SchemaError(
                f"database {shown} has tables ({', '.join(sorted(tables))}) but no schema_info: it "
                "is not an orchestrator database; give orchestrator.database_url an empty one"
            )
        version = conn.execute(select(SchemaInfo.version)).scalar_one()
        if version > SCHEMA_VERSION:
            engine.dispose()
            raise SchemaError(
                f"database {shown} has schema version {version}, written by a newer orchestrator "
                f"(this one knows up to {SCHEMA_VERSION}); upgrade intellect to open it"
            )
        while version < SCHEMA_VERSION:
            if version not in migrations:
                engine.dispose()
                raise SchemaError(
                    f"database {shown} has schema version {version} and this release cannot "
                    f"upgrade it to {SCHEMA_VERSION} (no migration from {version}); start a new "
                    "database or open it with the release that wrote it"
                )
            migrations[version](conn)
            version += 1
            conn.execute(text("UPDATE schema_info SET version = :v"), {"v": version})
    return engine


class HotPath:
    """The scheduler's hot statements (issue, announce, claim, verdict: several hundred transactions a second in
    a large pool) on one held connection.

    Each prebuilt Core statement is compiled once for the engine's dialect (per set of parameter names, for an
    INSERT or an UPDATE whose SET names the columns given). On SQLite the compiled SQL runs on the driver's own
    connection, with the column types' bind and result processors applied here: SQLAlchemy's per-execution
    machinery (execution context, events, result objects) costs several times the statement there. Elsewhere
    (PostgreSQL) a statement runs through `Connection.execute` as usual. Transactions stay SQLAlchemy's either way
    (`begin`), so its `commit` event, which durability.py listens to, fires as before.

    One caller at a time: the service's event loop.
    """

    def __init__(self, engine: Engine, *, direct: bool | None = None):
        self.engine = engine
        dialect = engine.dialect
        self.direct = (dialect.name == "sqlite" and dialect.paramstyle == "qmark") if direct is None else direct
        self._conn: Connection | None = None
        self._wrote = False
        self._plans: dict[tuple[Executable, tuple[str, ...]], _Plan] = {}

    @contextlib.contextmanager
    def begin(self) -> Iterator[Connection]:
        """A transaction on the held connection: committed at the end of the block if `write` ran in it (a
        transaction that only read ends without a commit, so nothing waits for an fsync), rolled back on an error."""
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = self._conn = self.engine.connect()
        transaction = conn.begin()
        self._wrote = False
        try:
            yield conn
        except BaseException:
            try:
                transaction.rollback()
            except Exception:
                self._discard(conn)
            raise
        try:
            if self._wrote:
                transaction.commit()
            else:
                transaction.rollback()
        except BaseException:  # what the driver's connection holds now is unknown: it goes, uncommitted work with it
            self._discard(conn)
            raise

    def _discard(self, conn: Connection) -> None:
        self._conn = None
        with contextlib.suppress(Exception):
            conn.invalidate()  # closes the driver's connection, which drops any transaction it still has open

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def rows(self, conn: Connection, stmt: Executable, params: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        """Every row of a SELECT, as mappings by column key."""
        if not self.direct:
            return [row._mapping for row in conn.execute(stmt, params)]
        plan = self._plan(stmt, params)
        cursor = conn.connection.driver_connection.execute(plan.sql, plan.values(params))
        try:
            if plan.keys is None:  # the names the SQL gives its columns (labels included), as Result's keys
                plan.keys = [d[0] for d in cursor.description]
            return [plan.row(values) for values in cursor.fetchall()]
        finally:
            cursor.close()

    def first(self, conn: Connection, stmt: Executable, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The first row of a SELECT (give it a LIMIT 1), or None."""
        rows = self.rows(conn, stmt, params)
        return rows[0] if rows else None

    def scalar(self, conn: Connection, stmt: Executable, params: Mapping[str, Any]) -> Any:
        """The first column of the first row, or None."""
        row = self.first(conn, stmt, params)
        return None if row is None else next(iter(row.values()))

    def write(self, conn: Connection, stmt: Insert | Update, params: Mapping[str, Any]) -> int | None:
        """Run an INSERT (returns the new row's integer primary key) or an UPDATE (returns None)."""
        self._wrote = True
        if not self.direct:
            result = conn.execute(stmt, params)
            return result.inserted_primary_key[0] if isinstance(stmt, Insert) else None
        plan = self._plan(stmt, params)
        cursor = conn.connection.driver_connection.execute(plan.sql, plan.values(params))
        try:
            return cursor.lastrowid if isinstance(stmt, Insert) else None
        finally:
            cursor.close()

    def _plan(self, stmt: Executable, params: Mapping[str, Any]) -> _Plan:
        names = tuple(params) if isinstance(stmt, (Insert, Update)) else ()
        plan = self._plans.get((stmt, names))
        if plan is None:
            plan = self._plans[(stmt, names)] = _Plan(stmt, self.engine.dialect, names)
        return plan


class _Plan:
    """A statement compiled for a positional dialect: its SQL, the order and processors of its parameters, and
    the keys and processors of its result columns."""

    def __init__(self, stmt: Executable, dialect, names: tuple[str, ...]):
        compiled = stmt.compile(dialect=dialect, column_keys=list(names) if names else None)
        if compiled.positiontup is None:
            raise ValueError(f"{dialect.name}: not a positional paramstyle")
        self.sql = compiled.string
        self.compiled = compiled
        self.order = list(compiled.positiontup)
        binds = {name: compiled.binds[name] for name in self.order}
        self.bind_processors = {
            name: proc
            for name, bind in binds.items()
            if (proc := bind.type.dialect_impl(dialect).bind_processor(dialect)) is not None
        }
        columns = list(getattr(stmt, "selected_columns", ()))
        self.keys: list[str] | None = None  # from the first cursor's description
        self.result_processors = [
            column.type.dialect_impl(dialect).result_processor(dialect, None) for column in columns
        ]
        if not any(self.result_processors):
            self.result_processors = None

    def values(self, params: Mapping[str, Any]) -> list[Any]:
        merged = self.compiled.construct_params(params)
        processors = self.bind_processors
        return [processors[name](merged[name]) if name in processors else merged[name] for name in self.order]

    def row(self, values: tuple) -> dict[str, Any]:
        if self.result_processors is not None:
            values = [value if proc is None else proc(value) for proc, value in zip(self.result_processors, values)]
        return dict(zip(self.keys, values))
