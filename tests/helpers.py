"""Helpers shared by the tests (tests/ is on `sys.path`, as tests/conftest.py's directory: `from helpers import`).

`OrchestratorProcess` starts `intellect orchestrator` as a child process on this machine and waits until it
answers; it runs exactly as a user starts it: `python -m intellect orchestrator`. `S3Server` starts moto's S3
API server (`python -m moto.server`) on 127.0.0.1 with IAM enforced: a bucket and one user per role with that
role's permissions. `Served` runs a SHARDCAST server coroutine (origin or relay) on 127.0.0.1 in a thread.
`free_port` is the launcher's."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from intellect.launcher import free_port

__all__ = ["OrchestratorProcess", "S3Server", "free_port"]


class OrchestratorProcess:
    """`intellect orchestrator [config] --orchestrator.port PORT [overrides]`, its output in `log_path`."""

    def __init__(
        self,
        log_path: str | Path,
        config: str | Path | None = None,
        overrides: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
        env: Mapping[str, str] | None = None,
    ):
        self.host, self.port = host, port or free_port(host)
        self.env = {**os.environ, **(env or {})}
        self.url = f"http://{self.host}:{self.port}"
        self.log_path = Path(log_path)
        self.argv = [
            sys.executable,
            "-m",
            "intellect",
            "orchestrator",
            *([str(config)] if config else []),
            "--orchestrator.host",
            host,
            "--orchestrator.port",
            str(self.port),
            *overrides,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> OrchestratorProcess:
        """Start the process and return once GET /healthz answers; raises with the log if it does not."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"orchestrator exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"orchestrator did not answer on {self.url} within {timeout_s:g} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (a clean shutdown), then SIGKILL if it has not exited within `timeout_s`."""
        if self.proc is None:
            return 0
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int:
        """SIGKILL: no shutdown code runs."""
        if self.proc is None:
            return 0
        self.proc.kill()
        return self.proc.wait(15)

    def __enter__(self) -> OrchestratorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# What each role may do on the rollout bucket: the ingest writes (and clears what it refused), validators read
# and write their logprobs beside the batches they accept, the learner reads and deletes old versions
# (retention). Workers get no user at all.
S3_ROLES = {
    "ingest": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"],
    "validator": ["s3:GetObject", "s3:PutObject", "s3:ListBucket"],
    "learner": ["s3:GetObject", "s3:DeleteObject", "s3:ListBucket"],
    "pool": ["s3:*"],  # one user for every trusted role of `intellect run`, which shares one environment
}


class S3Server:
    """moto's S3 server on 127.0.0.1 (`python -m moto.server`), holding `bucket`, with IAM enforced once the
    bucket and one user per role of `S3_ROLES` exist: a request without a role's credentials gets 403.
    `credentials(role)` is that role's environment (AWS_*); `spec(path)` the store's kvstore spec as JSON."""

    region = "us-east-1"

    def __init__(self, log_path: str | Path, bucket: str = "rollouts", port: int | None = None):
        self.log_path, self.bucket = Path(log_path), bucket
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.keys: dict[str, tuple[str, str]] = {}

    def start(self, timeout_s: float = 90.0) -> S3Server:
        setup_actions = 1 + 3 * len(S3_ROLES)  # the bucket, then per user: create, policy, access key
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(setup_actions)}
        for name in [k for k in env if k.startswith("AWS_")]:
            del env[name]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"moto did not answer on {self.endpoint} within {timeout_s:g} s") from None
                time.sleep(0.2)
        import boto3

        setup = dict(endpoint_url=self.endpoint, region_name=self.region, aws_access_key_id="setup")
        boto3.client("s3", aws_secret_access_key="setup", **setup).create_bucket(Bucket=self.bucket)
        iam = boto3.client("iam", aws_secret_access_key="setup", **setup)
        arn = f"arn:aws:s3:::{self.bucket}"
        for role, actions in S3_ROLES.items():
            iam.create_user(UserName=role)
            policy = {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": actions, "Resource": [arn, arn + "/*"]}],
            }
            iam.put_user_policy(UserName=role, PolicyName="rollouts", PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=role)["AccessKey"]
            self.keys[role] = (key["AccessKeyId"], key["SecretAccessKey"])
        return self

    def credentials(self, role: str) -> dict[str, str]:
        key, secret = self.keys[role]
        return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}

    def spec(self, path: str) -> str:
        return json.dumps(
            {"driver": "s3", "bucket": self.bucket, "path": path, "endpoint": self.endpoint, "aws_region": self.region}
        )

    def client(self, role: str = "pool"):
        """A boto3 S3 client with `role`'s credentials."""
        import boto3

        key, secret = self.keys[role]
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
        )

    def snapshot(self, prefix: str = "") -> dict[str, bytes]:
        """Every object under `prefix` and its bytes (read with the pool's credentials)."""
        import concurrent.futures

        s3, keys, token = self.client(), [], None
        while True:
            page = s3.list_objects_v2(
                Bucket=self.bucket, Prefix=prefix, **({"ContinuationToken": token} if token else {})
            )
            keys += [item["Key"] for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                break
            token = page["NextContinuationToken"]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # the server answers GETs in threads
            bodies = pool.map(lambda key: s3.get_object(Bucket=self.bucket, Key=key)["Body"].read(), keys)
            return dict(zip(keys, bodies))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


class Served:
    """A SHARDCAST server coroutine run on its own event loop in a thread, until `close()`."""

    def __init__(self, serve, *args, **kw):
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.url = ""

        def ready(url: str) -> None:
            self.url = url
            started.set()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.task = self.loop.create_task(serve(*args, host="127.0.0.1", port=0, ready=ready, **kw))
            try:
                self.loop.run_until_complete(self.task)
            except asyncio.CancelledError:
                pass

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10), "server did not start"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)
