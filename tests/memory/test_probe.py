"""Fresh-process probes on tiny models (CPU): a real TRL GRPO step, the loss alone, OOM as a result, errors raised."""

import pytest

from grpo_lab.memory.probe import ProbeError, run_point
from grpo_lab.memory.spec import PointSpec

TINY = dict(model="tiny-qwen3", prompt_len=8, completion_len=8, device="cpu")


def test_grpo_step_point_runs_in_a_fresh_process():
    r = run_point(PointSpec(batch_size=2, loss_backend="trl", **TINY))
    assert r["status"] == "ok", r["message"]
    assert r["memory_kind"] == "cpu_rss"
    assert r["steps_done"] == 2
    assert r["peak_bytes"] > r["base_bytes"] > 0
    assert r["peak_generation_bytes"] is not None


def test_loss_point_and_backends():
    for backend in ("trl", "naive"):
        r = run_point(PointSpec(batch_size=4, loss_backend=backend, mode="loss", **TINY))
        assert r["status"] == "ok", r["message"]
        assert r["peak_bytes"] > 0


def test_over_budget_is_recorded_as_oom():
    r = run_point(PointSpec(batch_size=2, mode="loss", budget_bytes=1, **TINY))
    assert r["status"] == "oom"
    assert "budget" in r["message"]


def test_other_errors_stop_with_the_error_shown():
    with pytest.raises(ProbeError, match="requested failure: boom"):
        run_point(PointSpec(batch_size=2, extra={"fail": "boom"}, **TINY))
    r = run_point(PointSpec(batch_size=2, extra={"fail": "boom"}, **TINY), raise_on_error=False)
    assert r["status"] == "error" and "RuntimeError" in r["message"]


def test_pretrained_weights_from_a_local_folder(tmp_path):
    """Real weights stay possible (a hub id online; here a saved local folder, offline)."""
    from grpo_lab.models import build_model

    build_model("tiny-qwen3").save_pretrained(tmp_path / "m")
    r = run_point(PointSpec(model=str(tmp_path / "m"), pretrained=True, batch_size=2, prompt_len=8, completion_len=8,
                            device="cpu"))
    assert r["status"] == "ok", r["message"]
    with pytest.raises(ValueError, match="hub id"):
        PointSpec(model="not-a-hub-id", pretrained=True)


def test_generation_by_the_model_is_measured_separately():
    r = run_point(PointSpec(batch_size=2, generation="model", **TINY))
    assert r["status"] == "ok", r["message"]
    assert r["peak_generation_bytes"] > r["base_bytes"]


@pytest.mark.parametrize("fsdp", [False, True])
def test_a_single_sequence_batch_trains(fsdp):
    """B=1 needs a group of 2 spread over 2 optimizer steps; under FSDP2 it must not take the no-sync path that
    transformers only supports for models it sharded itself (a search that lands on B=1 used to crash there)."""
    r = run_point(PointSpec(batch_size=1, loss_backend="grpo_lab", lora_r=4 if fsdp else 0, fsdp=fsdp, **TINY))
    assert r["status"] == "ok", r["message"]
    assert r["steps_done"] == 2
