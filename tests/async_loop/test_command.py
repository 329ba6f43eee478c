"""`grpo-lab async-loop` as a new user meets it: every bad setting is refused before anything starts.

Each bad input must give exit status 2, exactly one line on stderr that names the flag at fault, no traceback, no
process left behind and nothing written.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from grpo_lab.async_loop import command
from grpo_lab.async_loop.recorder import METRICS_FILE
from grpo_lab.async_loop.run_dir import (RunDirError, check_output_dir, clear_previous_run, read_run_record,
                                         truncate_metrics, write_run_record)


class _Answer(http.server.BaseHTTPRequestHandler):
    status = 404

    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_response(self.status)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html>not a vLLM server</html>")

    def log_message(self, *args):
        pass


def _serve(status: int):
    handler = type("Handler", (_Answer,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def web_page():
    """An HTTP server that is not vLLM (a web page on every path)."""
    server = _serve(200)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def wants_a_key():
    """A server that refuses every request without credentials (HTTP 401)."""
    server = _serve(401)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _a_run(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / METRICS_FILE).write_text(json.dumps({"step": 1}) + "\n")
    (folder / "checkpoint-1").mkdir()
    return folder


# (id, arguments given the case's tmp folder and fixtures, the flag the message must name, a word it must contain)
CASES = [
    ("inflight-zero", lambda t, f: ["--max-inflight-tasks", "0"], "--max-inflight-tasks", ">= 1"),
    ("inflight-negative", lambda t, f: ["--max-inflight-tasks", "-5"], "--max-inflight-tasks", "-1"),
    ("steps-zero", lambda t, f: ["--max-steps", "0"], "--max-steps", ">= 1"),
    ("steps-negative", lambda t, f: ["--max-steps", "-3"], "--max-steps", ">= 1"),
    ("steps-not-a-number", lambda t, f: ["--max-steps", "ten"], "--max-steps", "integer"),
    ("lr-nan", lambda t, f: ["--learning-rate", "nan"], "--learning-rate", "finite"),
    ("lr-negative", lambda t, f: ["--learning-rate=-1e-3"], "--learning-rate", "> 0"),
    ("timeout-inf", lambda t, f: ["--rollout-failure-timeout", "inf"], "--rollout-failure-timeout", "finite"),
    ("one-generation", lambda t, f: ["--num-generations", "1"], "--num-generations", ">= 2"),
    ("no-replicas", lambda t, f: ["--replicas", "0"], "--replicas", ">= 1"),
    ("staleness-negative", lambda t, f: ["--max-staleness", "-1"], "--max-staleness", ">= 0"),
    ("liger-backend", lambda t, f: ["--loss-backend", "liger"], "--loss-backend", "choose from"),
    ("tree-attention", lambda t, f: ["--tree-attention", "bogus"], "--tree-attention", "choose from"),
    ("port-too-high", lambda t, f: ["--port", "70000"], "--port", "65535"),
    ("port-busy", lambda t, f: ["--port", str(f["busy_port"])], "--port", "in use"),
    ("model-missing", lambda t, f: ["--model", str(t / "no-such-model")], "--model", "not a local directory"),
    ("model-is-a-file", lambda t, f: ["--model", str(f["file"])], "--model", "is a file"),
    ("model-without-config", lambda t, f: ["--model", str(f["empty_dir"])], "--model", "config.json"),
    ("storage-scheme", lambda t, f: ["--adapter-storage", "foo://x"], "--adapter-storage", "unknown storage scheme"),
    ("storage-under-a-file", lambda t, f: ["--adapter-storage", str(f["file"] / "adapters")], "--adapter-storage",
     "cannot be written"),
    ("output-is-a-file", lambda t, f: ["--output-dir", str(f["file"])], "--output-dir", "is a file"),
    ("output-holds-a-run", lambda t, f: ["--output-dir", str(f["run"])], "--output-dir", "--resume"),
    ("output-holds-other-files", lambda t, f: ["--output-dir", str(f["others"]), "--overwrite"], "--overwrite",
     "not an async-loop run"),
    ("resume-nothing", lambda t, f: ["--resume"], "--resume", "no complete checkpoint"),
    ("resume-and-overwrite", lambda t, f: ["--resume", "--overwrite"], "--resume", "contradict"),
    ("router-dead", lambda t, f: ["--router-url", f"http://127.0.0.1:{_dead_port()}"], "--router-url",
     "nothing answers"),
    ("router-not-vllm", lambda t, f: ["--router-url", f["web_page"]], "--router-url", "not a vLLM server"),
    ("router-not-http", lambda t, f: ["--router-url", "ftp://host/x"], "--router-url", "http"),
    ("router-wants-a-key", lambda t, f: ["--router-url", f["wants_a_key"]], "--router-url", "API key"),
    ("replica-dead", lambda t, f: ["--replica-url", f"http://127.0.0.1:{_dead_port()}"], "--replica-url",
     "nothing answers"),
    ("router-and-replicas", lambda t, f: ["--router-url", f["web_page"], "--replica-url", f["web_page"]],
     "--router-url", "not both"),
    ("results-under-a-file", lambda t, f: ["--results-dir", str(f["file"] / "r")], "--results-dir",
     "cannot be written"),
    ("run-name-with-slash", lambda t, f: ["--run-name", "a/b"], "--run-name", "file name"),
    ("ray-with-a-router", lambda t, f: ["--launcher", "ray", "--router-url", f["web_page"]], "--launcher ray",
     "not with --router-url"),
    ("ray-address-without-ray", lambda t, f: ["--ray-address", "auto"], "--ray-address", "--launcher ray"),
    ("unknown-launcher", lambda t, f: ["--launcher", "slurm"], "--launcher", "choose from"),
    ("config-without-a-file", lambda t, f: ["--config"], "--config", "expected one argument"),
    ("config-missing", lambda t, f: ["--config", str(t / "none.yaml")], "--config", "No such file"),
    ("config-not-a-mapping", lambda t, f: ["--config", str(f["file"])], "--config", "mapping"),
]


def _snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("make_args, flag, word", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_setting_is_one_line_naming_its_flag_and_nothing_starts(make_args, flag, word, tmp_path, capsys,
                                                                       web_page, wants_a_key, busy_port):
    fixtures = {"web_page": web_page, "wants_a_key": wants_a_key, "busy_port": busy_port,
                "file": tmp_path / "a-file", "empty_dir": tmp_path / "empty", "run": _a_run(tmp_path / "old-run"),
                "others": tmp_path / "notes"}
    fixtures["file"].write_text("x")
    fixtures["empty_dir"].mkdir()
    fixtures["others"].mkdir()
    (fixtures["others"] / "thesis.tex").write_text("x")
    args = make_args(tmp_path, fixtures)
    if "--output-dir" not in args:
        args += ["--output-dir", str(tmp_path / "out")]
    before, children = _snapshot(tmp_path), {p.pid for p in psutil.Process().children(recursive=True)}
    assert command.main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("--resume: skipping")]
    assert len(lines) == 1, err
    assert flag in lines[0] and word in lines[0], lines[0]
    assert "Traceback" not in err
    assert _snapshot(tmp_path) == before  # nothing written
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children  # nothing started


def test_the_vllm_interpreter_is_checked_before_replicas_start(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRPO_LAB_VLLM_PYTHON", sys.executable)  # a Python without vLLM
    monkeypatch.setattr(command, "cuda_available", lambda: False)
    assert command.main(["--replica-kind", "vllm", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--replica-kind vllm" in err and "has no vllm" in err
    assert not (tmp_path / "out").exists()


def test_the_installed_command_refuses_in_one_line_too(tmp_path):
    """Through the console entry point, in a fresh process: no traceback, status 2, the folder not created."""
    done = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "async-loop", "--max-inflight-tasks", "0",
                           "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "--max-inflight-tasks" in done.stderr
    assert not (tmp_path / "out").exists()


def test_help_lists_defaults_and_choices():
    text = command.build_parser().format_help()
    for needle in ("(default: 20)", "{trl,grpo_lab,naive}", "{auto,sdpa,flex,fa3}", "--replica-url URL",
                   "--port", "--overwrite", "(default: -1)", "--config FILE", "--pool-run NAME", "(default: loop)",
                   "--no-group-versions"):
        assert needle in text, needle
    assert "--max_steps" not in text  # one spelling per flag: the dashed one


def test_every_flag_of_before_still_parses():
    """The flags the hand-written parser had, each with a value, land on the settings field of that name."""
    s = command.parse_settings([
        "--output-dir", "o", "--resume", "--max-steps", "3", "--save-steps", "2", "--seed", "1", "--run-name", "r",
        "--results-dir", "res", "--report-to", "none", "--report-to", "none", "--checkpoint-storage", "c",
        "--model", "m", "--prompts-per-step", "3", "--num-generations", "4", "--learning-rate", "1e-4",
        "--loss-backend", "trl", "--tree-attention", "sdpa", "--max-staleness", "0", "--max-inflight-tasks", "5",
        "--autotune", "--queue-maxsize", "6", "--no-group-versions", "--rollout-failure-timeout", "7",
        "--replicas", "3", "--replica-kind", "vllm", "--replica-threads", "2", "--replica-url", "http://a:1",
        "--replica-url", "http://b:1", "--port", "9", "--run-weight", "2", "--adapter-storage", "a"])
    assert (s.output_dir, s.resume, s.max_steps, s.save_steps, s.seed, s.run_name, s.results_dir) == \
        ("o", True, 3, 2, 1, "r", "res")
    assert (s.trackers, s.checkpoint_storage, s.model, s.samples_per_step, s.learning_rate) == ([], "c", "m", 12, 1e-4)
    assert (s.loss_backend, s.tree_attention, s.max_staleness, s.inflight, s.autotune, s.queue_maxsize) == \
        ("trl", "sdpa", 0, 5, True, 6)
    assert (s.group_versions, s.rollout_failure_timeout, s.replicas, s.replica_kind, s.replica_threads) == \
        (False, 7.0, 3, "vllm", 2)
    assert (s.replica_url, s.port, s.run_weight, s.adapter_storage) == (["http://a:1", "http://b:1"], 9, 2.0, "a")
    assert s.trainer_values()["group_consistent_versions"] is False


# -- an output directory is one run ---------------------------------------------------------------------------------
def test_overwrite_clears_only_what_a_run_wrote(tmp_path):
    run = _a_run(tmp_path / "run")
    (run / "logs").mkdir()
    (run / "my-notes.txt").write_text("keep me")
    check_output_dir(run, resume=False, overwrite=True)
    assert sorted(clear_previous_run(run)) == ["checkpoint-1", "logs", METRICS_FILE]
    assert [p.name for p in run.iterdir()] == ["my-notes.txt"]


def test_resume_needs_no_empty_folder_and_new_folders_are_fine(tmp_path):
    run = _a_run(tmp_path / "run")
    check_output_dir(run, resume=True, overwrite=False)
    check_output_dir(tmp_path / "new", resume=False, overwrite=False)
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", resume=False, overwrite=False)
    with pytest.raises(RunDirError, match="--resume to continue"):
        check_output_dir(run, resume=False, overwrite=False)


def test_metrics_are_cut_back_to_the_checkpoint_on_resume(tmp_path):
    rows = [{"step": s} for s in range(1, 8)] + [{"step": 7, "train_runtime": 9.0}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "cut sho'
    (tmp_path / METRICS_FILE).write_text(text)
    assert truncate_metrics(tmp_path, 5) == 4  # steps 6 and 7, the old summary row and the torn line
    kept = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert kept == [{"step": s} for s in range(1, 6)]
    assert truncate_metrics(tmp_path, 5) == 0


def test_the_run_record_merges_across_a_resume(tmp_path):
    write_run_record(tmp_path, {"max_staleness": 2, "started_at": "t0"})
    write_run_record(tmp_path, {"resumed_at": "t1"})
    assert read_run_record(tmp_path / METRICS_FILE) == {"max_staleness": 2, "started_at": "t0", "resumed_at": "t1"}
    assert read_run_record(tmp_path / "elsewhere") is None


# -- the router binds before it announces ---------------------------------------------------------------------------
def test_the_router_on_a_busy_port_says_so_in_one_line(busy_port):
    done = subprocess.run([sys.executable, "-m", "grpo_lab.router", "--replica", "http://127.0.0.1:9", "--port",
                           str(busy_port)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "VLLM_API_KEY": ""})
    assert done.returncode == 2
    assert done.stdout == ""  # nothing announced
    assert done.stderr.strip().count("\n") == 0 and f"port {busy_port} is in use" in done.stderr


@pytest.mark.parametrize("fault, word", [("missing-bucket", "no such bucket"), ("wrong-key", "refused the credentials")])
def test_a_bad_object_store_is_one_line_before_anything_starts(fault, word, s3_url, monkeypatch, tmp_path, capsys):
    from s3_fixtures import forget_s3_clients

    url = f"s3://grpo-lab-missing-{os.getpid()}/run" if fault == "missing-bucket" else s3_url
    if fault == "wrong-key":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    forget_s3_clients()
    try:
        for flag in ("--adapter-storage", "--checkpoint-storage"):
            assert command.main([flag, url, "--output-dir", str(tmp_path / "out")]) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and flag in err and word in err, err
            assert not (tmp_path / "out").exists()
    finally:
        monkeypatch.undo()
        forget_s3_clients()
