"""FSDP2 + LoRA, 2 gloo processes on CPU: the loss and the LoRA gradients match the single-process run."""

import numpy as np
import pytest

from grpo_lab.memory.probe import run_point
from grpo_lab.memory.spec import PointSpec


# tied head (the small Qwen3s) and untied (8B+); TRL's fused head, the grpo_lab log-prob backend, Liger's fused loss
# `without_transformers_flag`: as on transformers < 5.19, which does not know `is_distributed_loading_by_transformers`
@pytest.mark.parametrize("model, backend, extra", [("tiny-qwen3", "trl", {}), ("tiny-qwen3-untied", "grpo_lab", {}),
                                                   ("tiny-qwen3", "liger", {}),
                                                   ("tiny-qwen3", "trl", {"without_transformers_flag": True})])
def test_two_process_fsdp2_lora_step_matches_single_process(model, backend, extra):
    if backend == "liger":
        pytest.importorskip("liger_kernel")
    # num_iterations=2: step 2 reuses step 1's completions with the updated policy, so its loss is not zero (an
    # on-policy GRPO loss with group-centred advantages vanishes) and the LoRA A gradients are non-zero (B moved)
    base = dict(model=model, loss_backend=backend, prompt_len=8, completion_len=8, lora_r=4, device="cpu", steps=2,
                num_iterations=2, dtype="fp32")
    two = run_point(PointSpec(batch_size=2, fsdp=True, world_size=2, extra=extra, **base), capture_grads=True)
    one = run_point(PointSpec(batch_size=4, **base), capture_grads=True)
    assert two["status"] == one["status"] == "ok"
    # the global loss is the mean of the ranks' losses (each rank normalises by the global token count / 2 ranks)
    rank_losses = np.array([r["losses"] for r in two["per_rank"]])
    assert abs(one["losses"][-1]) > 1e-6
    np.testing.assert_allclose(rank_losses.mean(axis=0), one["losses"], rtol=1e-4, atol=1e-7)
    g1, g2 = one["grads"], two["grads"]
    assert set(g1) == set(g2) and len(g1) > 0
    assert all("lora_" in k for k in g1)
    assert any(np.abs(g).max() > 0 for k, g in g1.items() if "lora_A" in k)
    for k in g1:
        np.testing.assert_allclose(g2[k], g1[k], rtol=1e-4, atol=1e-7, err_msg=k)
    # both ranks gathered the same full gradients
    for k, g in two["per_rank"][1]["grads"].items():
        np.testing.assert_array_equal(g, g2[k])
