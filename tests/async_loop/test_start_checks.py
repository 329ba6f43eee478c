"""Settings checked before anything starts (issue 43): a Ray address with nothing behind it, a storage URL with a
malformed scheme separator or no bucket, S3 without credentials, a store that cannot be written. Each is one line
naming its flag, exit status 2, nothing written and nothing started."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import psutil
import pytest

from grpo_lab.async_loop import checks, command
from s3_fixtures import REGION, forget_s3_clients


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refused(args: list[str], root: Path, capsys) -> str:
    """Run the command with `args`; assert exit 2, one line, nothing written under `root`, no child started."""
    before, children = _snapshot(root), {p.pid for p in psutil.Process().children(recursive=True)}
    assert command.main([*args, "--output-dir", str(root / "out")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert _snapshot(root) == before
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
    return lines[0]


@pytest.fixture
def no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}"])
def test_a_ray_address_with_nothing_behind_it_is_refused(address, tmp_path, capsys, no_ray_address):
    address = address.format(port=_dead_port())
    line = refused(["--launcher", "ray", "--ray-address", address], tmp_path, capsys)
    assert "--ray-address" in line and f"nothing answers at {address}" in line


def test_a_ray_address_that_answers_passes(no_ray_address):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        checks.check_ray_address("--ray-address", f"127.0.0.1:{port}")
        checks.check_ray_address("--ray-address", f"ray://127.0.0.1:{port}")
    checks.check_ray_address("--ray-address", None)  # a local cluster is started: nothing to reach
    with pytest.raises(checks.UsageError, match="not a Ray address"):
        checks.check_ray_address("--ray-address", "head-without-port")


def test_ray_address_auto_without_a_cluster_exits_2(tmp_path, capsys, monkeypatch, no_ray_address):
    from ray._private import services

    # this machine may run other people's Ray clusters: Ray's own lookup is made to find none
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset())
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    line = refused(["--launcher", "ray", "--ray-address", "auto"], tmp_path, capsys)
    assert "--ray-address" in line and "auto found no Ray cluster" in line


def test_ray_address_from_the_environment_is_checked_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_dead_port()}")
    line = refused(["--launcher", "ray"], tmp_path, capsys)
    assert line.split("error: ")[1].startswith("RAY_ADDRESS: nothing answers")


@pytest.mark.parametrize("url, word", [
    ("s3:/bucket/x", "did you mean s3://bucket/x"),
    ("s3:bucket", "did you mean s3://bucket"),
    ("gs:/bucket", "no '://'"),
    ("s3://", "names no bucket"),
    ("s3:///x", "names no bucket"),
    ("file://", "names no folder"),
])
def test_a_malformed_storage_url_is_refused_not_taken_as_a_local_path(url, word, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where `./s3:/bucket/x` would have been made
    for args in (["--adapter-storage"], ["--checkpoint-storage"], ["--resume", "--checkpoint-storage"]):
        line = refused([*args, url], tmp_path, capsys)
        assert args[-1] in line and word in line, line


def test_local_paths_and_well_formed_urls_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for ok in ("adapters", "runs/a:b", "./s3:x", str(tmp_path / "new" / "deeper"), f"file://{tmp_path}/x"):
        checks.check_storage("--adapter-storage", ok)
    assert _snapshot(tmp_path) == []  # the write probe is deleted, no folder is made


def test_s3_without_credentials_is_one_line(tmp_path, capsys, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask on this machine
    forget_s3_clients()
    try:
        for args in (["--adapter-storage"], ["--checkpoint-storage"], ["--resume", "--checkpoint-storage"]):
            line = refused([*args, "s3://some-bucket/run"], tmp_path, capsys)  # a resume reads the store: after
            assert args[-1] in line and "needs S3 credentials and none were found" in line, line
    finally:
        monkeypatch.undo()
        forget_s3_clients()


def _read_only_user(server) -> tuple[str, str]:
    """An IAM user of the moto server that may list and read the bucket but not write to it."""
    import boto3

    iam = boto3.client("iam", endpoint_url=server.endpoint, region_name=REGION, aws_access_key_id=server.key,
                       aws_secret_access_key=server.secret)
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:List*", "s3:Get*"],
                                                "Resource": "*"}]}))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


def test_a_store_that_cannot_be_written_is_refused_and_a_good_one_keeps_no_probe(s3_server, s3_url, monkeypatch):
    import s3fs

    checks.check_storage("--checkpoint-storage", s3_url)
    bucket = s3_url[len("s3://"):].split("/")[0]
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    assert fs.find(bucket) == []  # the probe object was deleted
    key, secret = _read_only_user(s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    forget_s3_clients()
    try:
        for flag in ("--checkpoint-storage", "--adapter-storage"):
            with pytest.raises(checks.UsageError) as refusal:  # listing is allowed: only the probe shows it
                checks.check_storage(flag, s3_url)
            assert str(refusal.value).startswith(f"{flag}: {s3_url}: the store refused"), refusal.value
    finally:
        monkeypatch.undo()
        forget_s3_clients()
