"""The offline default: a real TRL training step run by the kit makes no request to the Hub (TRL's trainers send
usage telemetry on every start unless told not to)."""

import os
import socket
import subprocess
import sys
import threading


def _fake_hub():
    """A local HTTP endpoint that records each request line (HF_ENDPOINT points the Hub client here)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    seen = []

    def serve():
        while True:
            conn, _ = srv.accept()
            seen.append(conn.recv(4096).split(b"\r\n")[0])
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", seen


def test_a_memory_probe_sends_nothing_to_the_hub(tmp_path):
    endpoint, seen = _fake_hub()
    code = ("from grpo_lab.memory import PointSpec, run_point\n"
            "r = run_point(PointSpec(model='tiny-qwen3', loss_backend='grpo_lab', batch_size=2, steps=1, device='cpu'))\n"
            "assert r['status'] == 'ok', r\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_TELEMETRY"}
    env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert seen == []


def test_telemetry_is_off_even_when_the_hub_client_was_imported_first():
    code = ("import huggingface_hub.constants as c; import grpo_lab; import os\n"
            "print(c.HF_HUB_DISABLE_TELEMETRY, os.environ['HF_HUB_DISABLE_TELEMETRY'])")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_TELEMETRY"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["True", "1"], r.stderr[-2000:]
    env["HF_HUB_DISABLE_TELEMETRY"] = "0"  # a user who wants it keeps it
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "0"], r.stderr[-2000:]
