"""Jupyter servers for the browser tier: started on loopback with a token the test made, stopped by their PID.

`start_lab` runs the user's own command, `grpo-lab lab --no-browser`, with a throwaway settings and workspaces
folder; `start_classic` runs nbclassic (the classic Notebook frontend) from the ipywidgets-7.7.1 environment.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# JupyterLab settings for a test run: every cell stays in the DOM (so a test sees every prompt), no news or update
# pop-ups (they need the network and cover the notebook).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                       "checkForUpdates": False},
}


@dataclass
class Server:
    process: subprocess.Popen
    url: str                # http://127.0.0.1:PORT
    token: str
    root: Path
    log: Path
    prefix: str = ""        # where the frontend's pages live under the server (nbclassic: /nbclassic next to Notebook 7)

    def get(self, path: str, timeout: float = 5.0) -> bytes:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def shutdown_kernels(self):
        for kernel in json.loads(self.get("/api/kernels")):
            req = urllib.request.Request(f"{self.url}/api/kernels/{kernel['id']}", method="DELETE",
                                         headers={"Authorization": f"token {self.token}"})
            urllib.request.urlopen(req, timeout=30).read()

    def stop(self, timeout: float = 20.0):
        """SIGTERM to the server's PID (it shuts its kernels down), then its process group if anything is left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)   # kernels the server did not reap (own group: see start)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], root: Path, port: int, workdir: Path, env: dict, ready_path: str,
           timeout_s: float) -> Server:
    token = secrets.token_hex(24)
    log = workdir / "server.log"
    # the token never appears on a command line; config, data and runtime files stay in the test's folder
    env = dict(env, JUPYTER_TOKEN=token, JUPYTER_CONFIG_DIR=str(workdir / "jupyter-config"),
               JUPYTER_DATA_DIR=str(workdir / "jupyter-data"), JUPYTER_RUNTIME_DIR=str(workdir / "jupyter-runtime"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", token, root, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Jupyter server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            server.get(ready_path)
            return server
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"the Jupyter server did not answer within {timeout_s:.0f}s:\n{server.log_tail()}")


def start_lab(root: Path, workdir: Path, env: dict | None = None, timeout_s: float = 120) -> Server:
    """`grpo-lab lab --no-browser` over `root` with fresh settings/workspaces under `workdir`."""
    settings = workdir / "lab-settings"
    for name, values in LAB_SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port = free_port()
    cmd = [sys.executable, "-m", "grpo_lab.cli", "lab", "--no-browser", "--root", str(root), "--port", str(port),
           "--", f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={workdir / 'workspaces'}",
           "--LabApp.news_url=", "--ServerApp.disable_check_xsrf=False"]
    return _start(cmd, root, port, workdir, dict(env or os.environ), "/api/status", timeout_s)


def start_classic(python: Path, root: Path, workdir: Path, env: dict | None = None,
                  timeout_s: float = 120) -> Server:
    """nbclassic from the environment of `python` (ipywidgets 7.7.1 + widgetsnbextension 3.6: Colab's protocol)."""
    port = free_port()
    cmd = [str(python), "-m", "nbclassic", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}"]
    if os.geteuid() == 0:
        cmd.append("--ServerApp.allow_root=True")
    prefix = subprocess.run([str(python), "-c", "from nbclassic import nbclassic_path; print(nbclassic_path())"],
                            capture_output=True, text=True, check=True).stdout.strip()
    server = _start(cmd, root, port, workdir, dict(env or os.environ), "/api/status", timeout_s)
    server.prefix = prefix
    return server
