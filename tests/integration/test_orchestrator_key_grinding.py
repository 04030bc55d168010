"""Issue 49 item 4: draws no key can grind. Under protocol 1 a key's assignments were a public function of
(node key, version, k), so a worker could compute the first assignment of keys it had not registered and register
only the one whose prompts it liked. The orchestrator now salts every draw with a secret of its own (kept in its
database): an attacker that grinds keys offline, with the public function or with a guessed secret, predicts
nothing of what the service hands out, while the worker and the validator, given the salt, recompute the draws
exactly, and a restarted service keeps them. Against the in-process service of test_orchestrator_state."""

import secrets

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import create_engine
from test_orchestrator_state import HW, Pool

from bridge.assignment import assigned_sample_seeds, assigned_task_ids, assignment_salt
from orchestrator.db import ASSIGNMENT_SECRET, service_secret, sqlite_url

NUM_TASKS, PROMPTS, GROUP, KEYS = 10_000, 8, 2, 24
SETTINGS = {
    "orchestrator.num_tasks": NUM_TASKS,
    "orchestrator.prompts_per_assignment": PROMPTS,
    "data.samples_per_prompt": GROUP,
    "data.prompts_per_step": PROMPTS * KEYS,  # room in the window for every key's first assignment
    "trainer.batch_size": PROMPTS * KEYS * GROUP,
    "orchestrator.unproven_share": 1.0,
}


def _hex(private: Ed25519PrivateKey) -> str:
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def _draws(key: str, salt: str | None) -> tuple[list[int], list[int]]:
    tasks = assigned_task_ids(key, 0, 0, NUM_TASKS, PROMPTS, salt)
    return tasks, assigned_sample_seeds(key, 0, 0, PROMPTS * GROUP, salt)


def test_keys_ground_offline_predict_nothing_the_salted_draws_replay_and_survive_a_restart(tmp_path):
    pool = Pool(tmp_path, **SETTINGS)
    keys = [Ed25519PrivateKey.generate() for _ in range(KEYS)]
    guessed_secrets = [bytes(32), b"\xff" * 32, *(secrets.token_bytes(32) for _ in range(6))]
    # the attacker's work, before any key is registered: each key's first assignment at version 0
    public = {_hex(k): _draws(_hex(k), None) for k in keys}
    guessed = {_hex(k): [_draws(_hex(k), assignment_salt(g, _hex(k), 0, 0)) for g in guessed_secrets] for k in keys}
    handed = {}
    for private in keys:
        node = pool.client(private)
        assert node.register("worker", HW).status == "admitted"
        [a] = node.heartbeat().assignments
        assert (a.version, a.k) == (0, 0) and a.salt is not None
        handed[node.node_key] = (a, node)
    for key, (a, _) in handed.items():
        tasks, seeds = list(a.task_ids), list(a.sample_seeds)
        # the public function and every guessed secret predict neither a prompt list nor a seed of it
        predictions = [public[key], *guessed[key]]
        assert all(tasks != t for t, _ in predictions), key
        assert all(not set(seeds) & set(s) for _, s in predictions), key
        # given the salt, the worker (its task ids) and the validator (both) recompute the draws exactly
        assert (tasks, seeds) == _draws(key, a.salt)
    # the validator learns the salt with the batch it claims; nobody else sees it
    key, (a, node) = next(iter(handed.items()))
    pool.submit(node, a, "ground-1")
    validator = pool.node("validator")
    claimed = validator.claim().batch
    assert claimed.batch_id == "ground-1" and claimed.assignment_salt == a.salt
    public_listing = pool.http.get("/v1/batches", params={"status": "validating"}).json()["batches"]
    assert public_listing and all("assignment_salt" not in b for b in public_listing)
    # deterministic: the salt is an HMAC of (key, version, k) under the secret in the database, which a restarted
    # service keeps, so a resumed pool (or a rolled-back one issuing the same slot again) draws the same
    engine = create_engine(sqlite_url(tmp_path / "orchestrator.db"))
    with engine.connect() as conn:
        secret = service_secret(conn, ASSIGNMENT_SECRET)
    assert all(a.salt == assignment_salt(secret, key, 0, 0) for key, (a, _) in handed.items())
    pool.svc.close()
    again = Pool(tmp_path, **SETTINGS)
    with engine.connect() as conn:
        assert service_secret(conn, ASSIGNMENT_SECRET) == secret
    a = handed[_hex(keys[1])][0]
    [b] = again.client(keys[1]).heartbeat().assignments  # its open assignment, handed out again after the restart
    assert (b.id, b.salt, b.task_ids, b.sample_seeds) == (a.id, a.salt, a.task_ids, a.sample_seeds)
    again.svc.close()
    engine.dispose()
