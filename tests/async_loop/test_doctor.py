"""The doctor names the bound side and the right knob, on synthetic streams of each regime and a recorded run."""

import json
from pathlib import Path

import pytest

from grpo_lab.async_loop.doctor import DoctorConfig, diagnose, replica_notes

RECORDED = Path(__file__).parent / "data" / "cpu_loop_metrics.jsonl"
ROOT = Path(__file__).resolve().parents[2]


def stream(n=12, *, step_s=2.0, wait=0.0, fwd_bwd=1.5, sync=0.2, queue=4.0, per_step=16.0, staleness=1.0,
           backpressure=None, dropped=0.0, abandoned=0.0, inflight=None):
    rows = []
    for i in range(n):
        r = {"step": i + 1, "perf/step_s": step_s, "perf/rollout_wait_s": wait, "perf/fwd_bwd_s": fwd_bwd,
             "perf/weight_sync_s": sync, "sample/rollout_queue_size": queue, "batch/samples_per_step": per_step,
             "batch/groups_per_step": per_step / 8, "sample/staleness_mean": staleness, "ratio": 1.0, "reward": 0.5}
        if backpressure is not None:
            r["rollout/backpressure_s"] = backpressure
        if dropped:
            r["sample/dropped_stale_total"] = dropped
        if abandoned:
            r["rollout/abandoned_groups_total"] = abandoned
        if inflight is not None:
            r["rollout/inflight"] = inflight
        rows.append(r)
    rows.append({"train_runtime": 10.0, "step": n})  # the summary row is ignored
    return rows


def test_rollout_bound_asks_for_replicas():
    v = diagnose(stream(step_s=4.0, wait=2.5, queue=0.0), max_staleness=4, max_inflight_tasks=64)
    assert v.bound == "rollout" and "replicas" in v.knobs[0]
    assert v.evidence["rollout_wait_frac"] == pytest.approx(2.5 / 4.0)


def test_rollout_bound_with_every_slot_busy_asks_for_more_in_flight():
    v = diagnose(stream(step_s=4.0, wait=2.5, queue=0.0, inflight=64), max_staleness=4, max_inflight_tasks=64)
    assert v.bound == "rollout" and "max_inflight_tasks" in v.knobs[0]


def test_train_bound_asks_for_packing_and_checkpointing():
    v = diagnose(stream(step_s=3.0, wait=0.0, fwd_bwd=2.7, queue=40.0, backpressure=1.5), max_staleness=4)
    assert v.bound == "train"
    assert "token_budget" in v.knobs[0] and any("checkpointing" in k for k in v.knobs)
    assert any("grpo_lab" in k for k in v.knobs)


def test_train_bound_by_weight_sync_puts_sync_cadence_first():
    v = diagnose(stream(step_s=3.0, wait=0.0, fwd_bwd=1.2, sync=1.5, queue=40.0), max_staleness=4)
    assert v.bound == "train" and "weight_sync_steps" in v.knobs[0]
    assert any("weight sync" in n for n in v.notes)


def test_staleness_bound_asks_for_fewer_waiting_samples():
    v = diagnose(stream(queue=60.0, staleness=3.6, dropped=4.0), max_staleness=4)
    assert v.bound == "staleness" and "max_inflight_tasks" in v.knobs[0]
    assert any("max_staleness" in k for k in v.knobs)


def test_staleness_with_slow_generation_puts_replicas_first():
    v = diagnose(stream(step_s=4.0, wait=2.0, queue=0.0, staleness=1.0, abandoned=1.0), max_staleness=4)
    assert v.bound == "staleness" and "replicas" in v.knobs[0]


def test_one_request_at_a_time_replicas_never_get_more_in_flight():
    # every slot busy on CPU replicas: more in flight would only queue at the replicas, so only replicas are asked for
    cpu = DoctorConfig.for_replicas("cpu")
    v = diagnose(stream(step_s=4.0, wait=2.5, queue=0.0, inflight=16), max_staleness=4, max_inflight_tasks=16,
                 config=cpu)
    assert v.bound == "rollout" and v.knobs and all("max_inflight_tasks" not in k for k in v.knobs)
    assert "replicas" in v.knobs[0] and any("one request at a time" in n for n in v.notes)
    # stale with slow generation: fewer waiting samples comes before more replicas
    v = diagnose(stream(step_s=4.0, wait=2.0, queue=0.0, staleness=3.8, abandoned=1.0), max_staleness=4, config=cpu)
    assert v.bound == "staleness" and "max_inflight_tasks" in v.knobs[0] and "replicas" in v.knobs[1]
    assert DoctorConfig.for_replicas("vllm").replicas_batch and not cpu.replicas_batch


def test_balanced():
    v = diagnose(stream(step_s=2.0, wait=0.3, queue=8.0), max_staleness=4)
    assert v.bound == "balanced" and v.knobs == []
    assert "balanced" in v.headline


def test_too_few_steps_is_unknown():
    assert diagnose(stream(n=1), max_staleness=4).bound == "unknown"
    assert diagnose([], max_staleness=4).bound == "unknown"


def test_window_reads_only_the_last_steps():
    rows = stream(n=20, step_s=4.0, wait=2.5, queue=0.0)[:-1] + stream(n=10, step_s=3.0, fwd_bwd=2.8, queue=40,
                                                                       backpressure=1.0)
    assert diagnose(rows, max_staleness=4, config=DoctorConfig(window=10)).bound == "train"


def test_recorded_cpu_run():
    """A real 20-step CPU loop (2 CPU replicas, 64 requests in flight, max_staleness 4): the replicas queue up more
    samples than the trainer takes, and they reach the staleness limit."""
    rows = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    v = diagnose(rows, max_staleness=4, max_inflight_tasks=64)
    assert v.bound == "staleness", v
    notes = replica_notes(rows)
    assert notes and "prefix affinity" in notes[0]


def test_doctor_cli_reads_a_recorded_run_for_cpu_replicas(tmp_path, capsys):
    from grpo_lab.async_loop.doctor import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "loop_metrics.jsonl").write_text(RECORDED.read_text())
    assert main([str(run), "--max-staleness", "4", "--max-inflight-tasks", "64", "--replica-kind", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("staleness-bound") and "1. fewer samples waiting" in out
    assert main([str(tmp_path / "nothing")]) == 2 and "no " in capsys.readouterr().err


def test_replica_notes_flag_an_overloaded_replica():
    rows = [{"router": {"routing": {"affinity": 0, "unmatched": 0}, "in_flight": {"a": 10, "b": 1, "c": 1}}},
            {"router": {"routing": {"affinity": 70, "unmatched": 10, "spilled": 0},
                        "in_flight": {"a": 12, "b": 0, "c": 2}}}]
    notes = replica_notes(rows)
    assert "87.5% prefix affinity" in notes[0]
    assert "replica a carries" in notes[1]


def test_board_feeds_from_logs_and_closes_once(capsys):
    """The board takes TRL's log dicts step by step, derives completions/s and affinity, re-diagnoses every
    `verdict_every` steps and draws its final figure once (training's end and the notebook both close it)."""
    from types import SimpleNamespace

    from grpo_lab.async_loop.board import LoopBoard, board_values

    rows = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    board = LoopBoard(total_steps=len(rows), max_staleness=4, mode="print", verdict_every=5)
    for row in rows:
        logs = {k: v for k, v in row.items() if k not in ("step", "time", "router")}
        board.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=row["step"]), None, logs=logs)
    assert len(board.rows) == len([r for r in rows if "train_runtime" not in r])
    assert "doctor: " in capsys.readouterr().out
    png = board.close()
    assert png[:4] == b"\x89PNG" and board.close() is png
    values = board_values(rows[5], rows[4]["router"])
    assert values["completions_per_s"] == rows[5]["batch/samples_per_step"] / rows[5]["perf/step_s"]
    assert 0.0 <= values["affinity"] <= 1.0


def test_committed_loop_runs_pair_each_csv_with_its_verdict():
    from grpo_lab.async_loop.notebook import committed_loop_runs

    table = committed_loop_runs()
    committed = sorted(p.name[: -len("_verdict.json")] for p in (ROOT / "results" / "async").glob("loop_*_verdict.json"))
    assert committed and list(table["run"]) == committed
    for row, name in zip(table.itertuples(), committed):
        verdict = json.loads((ROOT / "results" / "async" / f"{name}_verdict.json").read_text())
        assert row.verdict == verdict["bound"] and row.wall_s > 0


def _recorded_run(tmp_path, record: dict | None):
    run = tmp_path / "run"
    run.mkdir()
    (run / "loop_metrics.jsonl").write_text(RECORDED.read_text())
    if record is not None:
        (run / "run.json").write_text(json.dumps(record))
    return run


def test_doctor_judges_a_run_by_its_own_recorded_settings(tmp_path, capsys):
    from grpo_lab.async_loop.doctor import main

    run = _recorded_run(tmp_path, {"replica_kind": "cpu", "max_staleness": 4, "max_inflight_tasks": 64})
    assert main([str(run)]) == 0
    from_record = capsys.readouterr().out
    assert "judged with: replica_kind cpu (run), max_staleness 4 (run), max_inflight_tasks 64 (run)" in from_record
    assert main([str(run), "--max-staleness", "4", "--max-inflight-tasks", "64", "--replica-kind", "cpu"]) == 0
    from_flags = capsys.readouterr().out
    knob = [line for line in from_flags.splitlines() if line.strip().startswith("1.")]
    assert knob and knob[0] in from_record  # the record alone gives the same first knob as the right flags
    assert main([str(run), "--max-staleness", "8"]) == 0
    assert "max_staleness 8 (flag)" in capsys.readouterr().out  # a flag given overrides the record


def test_doctor_without_a_record_says_it_assumed_defaults(tmp_path, capsys):
    from grpo_lab.async_loop.doctor import main

    assert main([str(_recorded_run(tmp_path, None))]) == 0
    out = capsys.readouterr().out
    assert "replica_kind vllm (default)" in out and "no run.json" in out


def test_zero_affinity_from_prompts_shorter_than_a_block_is_explained():
    rows = [{"router": {"routing": {"affinity": 0, "unmatched": 0}}},
            {"router": {"routing": {"affinity": 0, "unmatched": 160, "spilled": 0}}}]
    plain = replica_notes(rows)
    assert "0.0% prefix affinity" in plain[0] and "expected" not in plain[0]
    explained = replica_notes(rows, block_size=32, prompt_tokens=25)
    assert "expected" in explained[0] and "shorter than one KV cache block (32 tokens)" in explained[0]
    assert "expected" not in replica_notes(rows, block_size=16, prompt_tokens=25)[0]  # longer than a block


def test_doctor_on_the_tensorboard_folder_finds_the_runs_record(tmp_path, capsys):
    """`grpo-lab doctor <out>/runs` (the TensorBoard logs transformers writes inside the run folder) judged the run
    by the defaults (vLLM replicas): the run.json one or two folders up was never looked for."""
    from torch.utils.tensorboard import SummaryWriter

    from grpo_lab.async_loop.doctor import main

    run = _recorded_run(tmp_path, {"replica_kind": "cpu", "max_staleness": 4, "max_inflight_tasks": 64})
    (run / "loop_metrics.jsonl").unlink()  # only the tracker's copy of the metrics
    writer = SummaryWriter(str(run / "runs" / "Dec06_13-00-00_host"))
    for row in (json.loads(line) for line in RECORDED.read_text().splitlines()):
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                writer.add_scalar(f"train/{key}", value, row["step"])
    writer.close()
    for path in (run / "runs", next((run / "runs").iterdir())):
        assert main([str(path)]) == 0
        out = capsys.readouterr().out
        assert "read from: TensorBoard run" in out and f"settings from {run / 'run.json'}" in out, out
        assert "judged with: replica_kind cpu (run), max_staleness 4 (run), max_inflight_tasks 64 (run)" in out
        assert "no run.json" not in out
