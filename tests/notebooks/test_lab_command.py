"""`grpo-lab lab` opens JupyterLab on this environment, on loopback only, at the notebooks folder."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from grpo_lab import cli
from grpo_lab.lab import jupyter as lab

ROOT = Path(__file__).resolve().parents[2]


def test_command_binds_loopback_and_opens_the_notebooks(tmp_path):
    cmd = lab.lab_command(ROOT, port=8899, open_browser=False, extra=["--foo=1"])
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert "--ServerApp.ip=127.0.0.1" in cmd and "--ServerApp.port=8899" in cmd
    assert f"--ServerApp.root_dir={ROOT}" in cmd and "--LabApp.default_url=/lab/tree/notebooks" in cmd
    assert "--ServerApp.open_browser=False" in cmd and cmd[-1] == "--foo=1"
    assert "--LabApp.default_url=/lab/tree/notebooks" not in lab.lab_command(tmp_path)


def test_bad_root_is_a_message(capsys):
    assert cli.main(["lab", "--root", "/nonexistent/folder", "--print-command"]) == 2
    assert "no folder" in capsys.readouterr().err


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _non_loopback_address():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))     # no packet is sent: this only picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


@pytest.mark.timeout(180)
def test_lab_serves_on_loopback_with_a_token_and_stops_by_pid(tmp_path):
    port, token = _free_port(), os.urandom(16).hex()
    env = dict(os.environ, JUPYTER_TOKEN=token, JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"))
    log = open(tmp_path / "lab.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "grpo_lab.cli", "lab", "--no-browser", "--port", str(port)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline and status is None:
            assert proc.poll() is None, (tmp_path / "lab.log").read_text()[-3000:]
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/api/contents/notebooks",
                                             headers={"Authorization": f"token {token}"})
                status = json.loads(urllib.request.urlopen(req, timeout=5).read())
            except OSError:
                time.sleep(0.5)
        assert status is not None, (tmp_path / "lab.log").read_text()[-3000:]
        names = {c["name"] for c in status["content"]}
        assert {"01_memory_vs_batch.ipynb", "03_sanity_reward_curves.ipynb"} <= names
        with pytest.raises(urllib.error.HTTPError) as denied:          # no token, no access
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents/notebooks", timeout=5)
        assert denied.value.code == 403
        other = _non_loopback_address()
        if other:                                                       # not reachable from the network
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=3).close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
