"""A real S3-compatible server for the tests: moto in server mode, as its own process on a host of its own.

Nothing is mocked inside the test process: s3fs talks HTTP to `python -m moto.server`, which the fixture starts, waits
for, and stops by its pid. Where network namespaces can be made (root, `ip`; see `netns`), the server runs in its own
namespace on the run's test network, at an address of its own (`http://10.213.N.k:5000`), which the root namespace
reaches through the bridge and the Ray tier's hosts across their links; a test can stop it or cut it off like a
store on another machine. Elsewhere it runs on a free loopback port (the S3 tests test storage, not the network),
unless GRPO_LAB_REQUIRE_NETNS=1 (CI), where that is a failure. The endpoint and credentials reach every client the way they reach one for a real
S3-compatible store (MinIO, Ceph, R2): `AWS_ENDPOINT_URL_S3`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_DEFAULT_REGION` in the environment, which the test process and every process it starts (replicas, sidecars,
publishers) inherit.

The server checks credentials: the fixture makes an IAM user with an access key allowed everything, then switches
moto's authentication on (`/moto-api/reset-auth`), so from then on a wrong key or secret is refused as AWS refuses it
(403 InvalidAccessKeyId / SignatureDoesNotMatch).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass

import netns
import pytest

REGION = "us-east-1"
S3_ROLE = "s3"  # the server's host on the test network
MOTO_PORT = 5000  # moto's default: a host of its own has its ports to itself
_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "AWS_PROFILE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """A running moto server and the credentials it accepts."""

    proc: subprocess.Popen
    endpoint: str
    key: str = ""
    secret: str = ""
    started_s: float = 0.0
    network: netns.Network | None = None  # the test network it is a host of (None: on loopback)
    role: str = S3_ROLE

    @property
    def pid(self) -> int:
        return self.proc.pid

    def env(self) -> dict[str, str]:
        """What a user exports to point s3fs (and any AWS SDK) at this store."""
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ACCESS_KEY_ID": self.key,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": REGION}

    def new_bucket(self) -> str:
        import boto3

        name = f"grpo-lab-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=self.key,
                     aws_secret_access_key=self.secret).create_bucket(Bucket=name)
        return name


def start_moto(log_dir: str | os.PathLike, timeout: float = 30.0, network: netns.Network | None = None,
               role: str = S3_ROLE) -> S3Server:
    """`python -m moto.server`, answering: on `network`, in a new host `role` at its address; else on a free loopback
    port. Its output goes to `log_dir/moto-<port>.log`."""
    if network is not None:
        address, port = network.add_host(role).address, MOTO_PORT
    else:
        address, port = "127.0.0.1", _free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", address, "-p", str(port)]
    log = open(os.path.join(log_dir, f"moto-{port}.log"), "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(network.command(role, argv) if network is not None else argv,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    server = S3Server(proc, f"http://{address}:{port}", network=network, role=role)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(server.endpoint + "/moto-api/data.json", timeout=1):
                break
        except (urllib.error.URLError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_moto(server)
                raise RuntimeError(f"moto server did not start on {server.endpoint} (log {log.name})")
            time.sleep(0.05)
    server.started_s = time.perf_counter() - t0
    return server


def enforce_auth(server: S3Server) -> None:
    """An IAM user allowed everything, its key as the server's credentials, then authentication switched on."""
    import boto3

    iam = boto3.client("iam", endpoint_url=server.endpoint, region_name=REGION, aws_access_key_id="setup",
                       aws_secret_access_key="setup")
    iam.create_user(UserName="grpo-lab")
    iam.put_user_policy(UserName="grpo-lab", PolicyName="everything", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName="grpo-lab")["AccessKey"]
    server.key, server.secret = key["AccessKeyId"], key["SecretAccessKey"]
    request = urllib.request.Request(server.endpoint + "/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert json.loads(answer.read())["status"] == "ok"


def stop_moto(server: S3Server) -> None:
    """SIGTERM by pid, SIGKILL if it lingers; returns once it is reaped (and its host is off the network)."""
    proc = server.proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    if server.network is not None:
        server.network.remove_host(server.role)


def forget_s3_clients() -> None:
    """Drop fsspec's cached s3 filesystems: the next one reads the environment (credentials, endpoint) again."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The moto server for the whole session (on the test network where namespaces can be made), with its endpoint
    and credentials in this process's environment (and so in every process the tests start); stopped by pid at the
    end, the environment restored."""
    with contextlib.ExitStack() as stack:
        reason = netns.unavailable_reason()
        if reason is not None and netns.required():
            pytest.fail(f"the S3 server's host needs network namespaces: {reason} ({netns.REQUIRE_ENV}=1)",
                        pytrace=False)
        network = stack.enter_context(netns.shared_network()) if reason is None else None
        server = start_moto(tmp_path_factory.mktemp("moto"), network=network)
        saved = {k: os.environ.get(k) for k in _ENV}
        try:
            enforce_auth(server)
            for k in _ENV:
                os.environ.pop(k, None)
            os.environ.update(server.env())
            forget_s3_clients()
            yield server
        finally:
            stop_moto(server)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            forget_s3_clients()
        assert server.proc.poll() is not None


@pytest.fixture
def s3_url(s3_server):
    """`s3://<a new bucket>/run`: a fresh, empty store for one test."""
    return f"s3://{s3_server.new_bucket()}/run"
