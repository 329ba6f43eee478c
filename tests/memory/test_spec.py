"""Bad input is a clear ValueError before any process starts."""

import pytest

from grpo_lab.memory.spec import PointSpec, parse_int_list
from grpo_lab.memory.sweep import build_specs


def test_unknown_model_and_backend():
    with pytest.raises(ValueError, match="Unknown model 'Qwen9-99B'"):
        PointSpec(model="Qwen9-99B")
    with pytest.raises(ValueError, match="Unknown loss_backend 'fast'"):
        PointSpec(loss_backend="fast")
    with pytest.raises(ValueError, match="Unknown dtype"):
        PointSpec(dtype="fp8")


@pytest.mark.parametrize("bad", [0, -4, 2.5, "two", True, None])
def test_batch_size_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="positive integer"):
        PointSpec(batch_size=bad)


@pytest.mark.parametrize("bad", ["0,2", "2,-1", "2,x", [], [1.5]])
def test_batch_size_lists(bad):
    with pytest.raises(ValueError, match="positive integer|at least one"):
        build_specs(batch_sizes=bad)


def test_parse_and_grid():
    assert parse_int_list("1, 2,4") == [1, 2, 4]
    specs = build_specs(model="tiny-qwen3", backends="trl,naive", dtypes="fp32,bf16", batch_sizes="2,4",
                        modes="step,loss", loss_batch_sizes=[8])
    assert len(specs) == 2 * 2 * 2 + 2 * 2 * 1
    assert {s.mode for s in specs} == {"step", "loss"}
