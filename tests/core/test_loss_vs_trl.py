"""The reference loss equals TRL's own `GRPOTrainer._compute_loss`, called on a real tiny trainer.

TRL's method runs its fused LM head on the model; the reference runs on log-probs from the `naive` backend of the
same model. Loss, gradients of every parameter and the logged metrics must agree. At the end: the loss reads nothing
on the host (its metrics stay tensors until read), with the same floats as the eager `.item()` reads it replaced.
"""

import contextlib
import math

import pytest
import torch

from grpo_lab.loss import reference
from grpo_lab.loss.config import LOSS_TYPES, GRPOLossConfig
from grpo_lab.loss.heads import logprob_head
from grpo_lab.loss.reference import GRPOLossOutput, LazyMetrics, grpo_loss, vllm_importance_sampling_ratio

B, P, T = 4, 5, 8


def make_inputs(trainer, seed, with_ref=False, with_vllm=False, config=None):
    gen = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(5, vocab, (B, P), generator=gen)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    completion_ids = torch.randint(5, vocab, (B, T), generator=gen)
    lengths = torch.tensor([T, 5, 3, 7])
    completion_mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    with torch.no_grad():
        logps, _ = per_token_logps_and_entropies(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=torch.randn(B, generator=gen),
                  old_per_token_logps=logps + 0.3 * torch.randn(B, T, generator=gen),
                  num_items_in_batch=completion_mask.sum() * 2.0)
    if with_ref:
        inputs["ref_per_token_logps"] = logps + 0.2 * torch.randn(B, T, generator=gen)
    if with_vllm:
        inputs["sampling_per_token_logps"] = inputs["old_per_token_logps"] + 0.05 * torch.randn(B, T, generator=gen)
        inputs["importance_sampling_ratio"] = vllm_importance_sampling_ratio(
            inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], completion_mask, config)
    return inputs


def per_token_logps_and_entropies(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask):
    model = trainer.model
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1][:, -T:]
    head = model.get_output_embeddings()
    lp, ent, *_ = logprob_head("naive")(hidden.reshape(-1, hidden.size(-1)), head.weight, head.bias,
                                                completion_ids.reshape(-1), trainer.temperature, None, None, 1.0,
                                                ("log_probs", "entropy"))
    return lp.view(B, T), ent.view(B, T)


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(trainer_factory, seed=0, accumulation=1, use_vllm=False, edit_inputs=None, **config):
    trainer = trainer_factory(temperature=0.9, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    cfg = GRPOLossConfig.from_trl_args(trainer.args)
    inputs = make_inputs(trainer, seed, with_ref=cfg.beta != 0, with_vllm=use_vllm, config=cfg)
    if edit_inputs is not None:
        edit_inputs(inputs)
    trainer.use_vllm = use_vllm
    if use_vllm:
        trainer.vllm_importance_sampling_correction = True

    trainer.model.zero_grad()
    trl_loss = trainer._compute_loss(trainer.model, dict(inputs))
    trl_loss.backward()
    trl_grads = grads_of(trainer.model)
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    trainer.model.zero_grad()
    logps, ents = per_token_logps_and_entropies(trainer, inputs["prompt_ids"], inputs["prompt_mask"],
                                                inputs["completion_ids"], inputs["completion_mask"])
    out = grpo_loss(logps, inputs["completion_mask"], inputs["advantages"], cfg,
                    old_per_token_logps=inputs["old_per_token_logps"],
                    ref_per_token_logps=inputs.get("ref_per_token_logps"), entropies=ents,
                    importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                    sampling_per_token_logps=inputs.get("sampling_per_token_logps"),
                    num_items_in_batch=inputs["num_items_in_batch"], gradient_accumulation_steps=accumulation,
                    steps_per_generation=trainer.args.steps_per_generation)
    out.loss.backward()
    ours = grads_of(trainer.model)

    torch.testing.assert_close(out.loss.detach(), trl_loss.detach(), atol=1e-6, rtol=1e-5)
    assert trl_grads.keys() == ours.keys() and len(ours) > 0
    for name in ours:
        torch.testing.assert_close(ours[name], trl_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    for key, value in out.metrics.items():
        assert key in trl_metrics, key
        assert value == pytest.approx(trl_metrics[key], abs=1e-6, nan_ok=True), key
    assert abs(trl_loss.item()) > 0  # the comparison is not vacuous
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_and_level(trainer_factory, loss_type, level):
    compare(trainer_factory, loss_type=loss_type, importance_sampling_level=level, epsilon_high=0.28)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_kl_with_and_without_bias_correction(trainer_factory, loss_type, bias_correction):
    out = compare(trainer_factory, loss_type=loss_type, beta=0.1, use_bias_correction_kl=bias_correction)
    assert out.metrics["kl"] > 0


def test_two_sided_clipping_delta(trainer_factory):
    compare(trainer_factory, loss_type="grpo", delta=1.05)

    def far_off_policy(inputs):  # ratios ~e^0.8 with positive advantages: above 1 + epsilon, clamped by delta
        inputs["old_per_token_logps"] = inputs["old_per_token_logps"] - 0.8
        inputs["advantages"] = inputs["advantages"].abs()

    out = compare(trainer_factory, loss_type="grpo", delta=1.05, edit_inputs=far_off_policy)
    assert out.metrics["clip_ratio/high_mean"] == 0.0  # TRL's metric sees the clamped ratio, 1.05 < 1.2


VLLM_CASES = [(mode, "dapo") for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")]
VLLM_CASES += [("token_truncate", "vespo"), ("token_mask", "vespo")]  # TRL rejects VESPO with sequence-level IS


@pytest.mark.parametrize("mode, loss_type", VLLM_CASES)
def test_vllm_importance_sampling_modes(trainer_factory, mode, loss_type):
    compare(trainer_factory, use_vllm=True, loss_type=loss_type, vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.1)


def test_entropy_mask(trainer_factory):
    compare(trainer_factory, loss_type="dapo", top_entropy_quantile=0.5)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_entropy_bonus(trainer_factory, loss_type):
    out = compare(trainer_factory, loss_type=loss_type, entropy_coef=0.05, top_entropy_quantile=0.7)
    assert "policy_loss" in out.metrics


def test_off_policy_mask(trainer_factory):
    compare(trainer_factory, loss_type="dapo", off_policy_mask_threshold=0.01, use_vllm=True)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_gradient_accumulation_scaling(trainer_factory, loss_type):
    compare(trainer_factory, accumulation=2, loss_type=loss_type, gradient_accumulation_steps=2)


def test_vllm_ratio_modes_behave():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    sampling = torch.tensor([[0.0, -1.5, -2.0]])
    mask = torch.ones(1, 3)
    cfg = GRPOLossConfig(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.5)
    assert vllm_importance_sampling_ratio(old, sampling, mask, cfg).tolist() == [[1.0, 0.0, 1.0]]
    cfg = GRPOLossConfig(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.5)
    assert vllm_importance_sampling_ratio(old, sampling, mask, cfg)[0, 1].item() == pytest.approx(1.5)
    cfg = GRPOLossConfig(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=9.0)
    assert vllm_importance_sampling_ratio(old, sampling, mask, cfg).shape == (1, 1)


# --- metrics stay on the device: no host read inside grpo_loss, the same floats once read ---------------------------

def eager_masked_mean(x, mask):
    """`reference._masked_mean` as it was when every metric was read at once (`.item()`), as an exact float64 tensor."""
    value = (x.sum() / max(x.shape[0], 1)) if x.shape[1] == 1 else ((x * mask).sum() / mask.sum().clamp(min=1.0))
    return torch.tensor(value.item(), dtype=torch.float64)


def eager_nan_reduce(x, reduce):
    """`reference._nan_reduce` as it was: boolean indexing drops the NaNs, then one host read."""
    x = x[~torch.isnan(x)]
    return torch.tensor(float("nan") if x.numel() == 0 else reduce(x).item(), dtype=torch.float64)


def eager_high_entropy_mask(entropies, mask, quantile):
    """`reference.high_entropy_mask` as it was: boolean indexing, then `torch.quantile`."""
    valid = entropies[mask.bool()].float()
    if valid.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    return ((entropies * mask.float()) >= torch.quantile(valid, quantile)) & mask.bool()


def metric_inputs(device="cpu", b=5, t=7, seed=0):
    """Random loss inputs with an all-zero-mask sequence (row 2), so the per-sequence clip metrics meet a NaN."""
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(b, t, generator=gen) * 3
    mask = (torch.rand(b, t, generator=gen) < 0.8).float()
    mask[:, 0], mask[2] = 1.0, 0.0
    inputs = {"per_token_logps": logps, "completion_mask": mask, "advantages": torch.randn(b, generator=gen),
              "old_per_token_logps": logps + 0.4 * torch.randn(b, t, generator=gen),
              "ref_per_token_logps": logps + 0.2 * torch.randn(b, t, generator=gen),
              "entropies": torch.rand(b, t, generator=gen) * 4, "num_items_in_batch": mask.sum() * 2.0,
              "sampling_per_token_logps": logps + 0.1 * torch.randn(b, t, generator=gen),
              "importance_sampling_ratio": 0.8 + 0.4 * torch.rand(b, 1, generator=gen)}
    return {k: v.to(device) for k, v in inputs.items()}


METRIC_CASES = {
    "grpo": {"loss_type": "grpo"},
    "grpo_kl_entropy_bonus": {"loss_type": "grpo", "beta": 0.1, "entropy_coef": 0.05},
    "dapo_sequence_is_ratio": {"loss_type": "dapo", "vllm_importance_sampling_correction": True},
    "dapo_sequence_level": {"loss_type": "dapo", "importance_sampling_level": "sequence", "epsilon_high": 0.28},
    "dapo_top_entropy": {"loss_type": "dapo", "top_entropy_quantile": 0.6, "entropy_coef": 0.02},
    "cispo_kl": {"loss_type": "cispo", "beta": 0.05},
    "vespo_off_policy_mask": {"loss_type": "vespo", "off_policy_mask_threshold": 0.01},
}


def call_loss(inputs, config, drop=()):
    args = {k: v for k, v in inputs.items() if k not in drop}
    if config.beta == 0.0:
        args.pop("ref_per_token_logps")
    return grpo_loss(args.pop("per_token_logps"), args.pop("completion_mask"), args.pop("advantages"), config, **args)


def eager_and_lazy(monkeypatch, inputs, config):
    """The loss output of today's grpo_loss and of the same code with the old eager helpers swapped back in."""
    lazy = call_loss(inputs, config)
    with monkeypatch.context() as m:
        m.setattr(reference, "_masked_mean", eager_masked_mean)
        m.setattr(reference, "_nan_reduce", eager_nan_reduce)
        m.setattr(reference, "high_entropy_mask", eager_high_entropy_mask)
        eager = call_loss(inputs, config)
    return lazy, eager


def assert_same_floats(got, expected):
    assert list(got) == list(expected)
    for key in expected:
        assert isinstance(got[key], float), key
        assert got[key] == expected[key] or (math.isnan(got[key]) and math.isnan(expected[key])), key


@pytest.mark.parametrize("case", sorted(METRIC_CASES))
def test_device_metrics_equal_the_eager_reads(monkeypatch, case):
    config = GRPOLossConfig(**METRIC_CASES[case])
    lazy, eager = eager_and_lazy(monkeypatch, metric_inputs(), config)
    assert torch.equal(lazy.loss, eager.loss)  # the entropy mask (top_entropy case) is the same bit for bit
    assert_same_floats(lazy.metrics, {k: float(v) for k, v in eager.metrics.items()})
    assert ("kl" in lazy.metrics) == (config.beta != 0.0) and "entropy" in lazy.metrics
    assert ("policy_loss" in lazy.metrics) == (config.entropy_coef != 0.0)


def test_every_sequence_masked_gives_nan_extremes(monkeypatch):
    inputs = metric_inputs()
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    lazy, eager = eager_and_lazy(monkeypatch, inputs, GRPOLossConfig(loss_type="grpo"))
    assert math.isnan(lazy.metrics["clip_ratio/low_min"]) and math.isnan(lazy.metrics["clip_ratio/high_max"])
    assert_same_floats(lazy.metrics, {k: float(v) for k, v in eager.metrics.items()})


def test_metrics_by_hand():
    """Row 0: first token's ratio e^-0.5 < 1 - 0.2 with a negative advantage (clipped low); row 1 fully masked."""
    logps = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    out = grpo_loss(logps, torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([-1.0, 1.0]), GRPOLossConfig(loss_type="grpo"),
                    old_per_token_logps=logps + torch.tensor([[0.5, 0.0], [0.0, 0.0]]),
                    entropies=torch.tensor([[1.0, 3.0], [5.0, 7.0]]))
    assert dict(out.metrics) == {"entropy": 2.0, "clip_ratio/low_mean": 0.5, "clip_ratio/high_mean": 0.0,
                                 "clip_ratio/region_mean": 0.5, "clip_ratio/low_min": 0.5, "clip_ratio/high_max": 0.0}


def test_valid_quantile_is_torch_quantile_bit_for_bit():
    from grpo_lab.loss.reference import valid_quantile

    gen = torch.Generator().manual_seed(1)
    for trial, dtype in enumerate((torch.float32, torch.bfloat16, torch.float64) * 6):
        n = int(torch.randint(1, 3000, (1,), generator=gen))
        x = (torch.randn(n, generator=gen) * 3).to(dtype)
        if trial % 4 == 0:
            x = x.round()  # ties
        valid = torch.rand(n, generator=gen) < (0.3, 1.0, 0.6)[trial % 3]
        valid[0] = True
        for q in (0.0, 0.2, 1 / 3, 0.5, 0.9, 1.0, float(torch.rand((), generator=gen))):
            assert torch.equal(valid_quantile(x, valid, q), torch.quantile(x[valid].float(), q).view(1)), (trial, q)
    x[0] = float("nan")  # a valid NaN makes torch.quantile NaN
    assert valid_quantile(x, valid, 0.5).isnan().all() and torch.quantile(x[valid].float(), 0.5).isnan()
    assert valid_quantile(x, torch.zeros_like(valid), 0.5).isnan().all()  # nothing valid: no token reaches it


_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def no_host_reads():
    """Inside, reading a tensor's value on the host or indexing with a boolean mask raises (restored after)."""
    def refuse(name):
        def refused(*args, **kwargs):
            raise AssertionError(f"grpo_loss read a tensor on the host ({name})")
        return refused

    get_item = torch.Tensor.__getitem__

    def getitem(self, index):
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            raise AssertionError("grpo_loss indexed with a boolean mask")
        return get_item(self, index)

    saved = {name: torch.Tensor.__dict__.get(name) for name in (*_HOST_READS, "__getitem__", "nonzero")}
    try:
        for name in (*_HOST_READS, "nonzero"):
            setattr(torch.Tensor, name, refuse(name))
        torch.Tensor.__getitem__ = getitem
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


@pytest.mark.parametrize("helper, eager, caught", [("_masked_mean", eager_masked_mean, "item"),
                                                    ("_nan_reduce", eager_nan_reduce, "boolean mask"),
                                                    ("high_entropy_mask", eager_high_entropy_mask, "boolean mask")])
def test_no_host_reads_guard_catches_the_eager_helpers(monkeypatch, helper, eager, caught):
    monkeypatch.setattr(reference, helper, eager)
    with no_host_reads(), pytest.raises(AssertionError, match=caught):
        call_loss(metric_inputs(), GRPOLossConfig(loss_type="grpo", top_entropy_quantile=0.5))
    assert torch.ones(()).item() == 1.0 and torch.ones(3)[torch.ones(3) > 0].tolist() == [1.0] * 3  # restored


@pytest.mark.parametrize("case", sorted(METRIC_CASES))
def test_grpo_loss_reads_nothing_on_the_host(case):
    config = GRPOLossConfig(**METRIC_CASES[case])
    inputs = metric_inputs()
    inputs["num_items_in_batch"] = 57.0  # a plain number is turned into a tensor on the loss's device
    with no_host_reads():
        out = call_loss(inputs, config)
    assert isinstance(out.metrics, LazyMetrics) and "entropy" in out.metrics and len(out.metrics) >= 2
    assert all(isinstance(v, float) for v in out.metrics.values())  # read afterwards, as floats


def test_lazy_metrics_behave_like_a_dict_of_floats(monkeypatch):
    metrics = LazyMetrics({"a": torch.tensor(0.25), "b": torch.tensor(2.0, dtype=torch.float64)})
    assert "a" in metrics and "c" not in metrics and len(metrics) == 2 and list(metrics) == ["a", "b"]
    assert set(metrics.tensors()) == {"a", "b"} and metrics.tensors()["a"].dim() == 0
    assert metrics == {"a": 0.25, "b": 2.0} and {"a": 0.25, "b": 2.0} == metrics and metrics != {"a": 0.25}
    assert dict(metrics) == {"a": 0.25, "b": 2.0} and type(metrics["a"]) is float
    assert metrics.get("c") is None and metrics.get("a") == 0.25 and list(metrics.items()) == [("a", 0.25), ("b", 2.0)]
    assert repr(metrics) == "LazyMetrics({'a': 0.25, 'b': 2.0})"
    with pytest.raises(KeyError):
        metrics["c"]
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("read twice"))
    assert metrics["a"] == 0.25  # read once, then kept
    assert LazyMetrics() == {} and len(GRPOLossOutput(torch.zeros(()), torch.zeros(())).metrics) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", sorted(METRIC_CASES))
def test_cuda_loss_never_synchronises(monkeypatch, case):
    """On CUDA, PyTorch's sync debug mode raises at any wait for the GPU; the metrics are still the eager ones."""
    config = GRPOLossConfig(**METRIC_CASES[case])
    inputs = metric_inputs("cuda", b=64, t=512)
    inputs["per_token_logps"].requires_grad_()
    inputs["num_items_in_batch"] = 123456.0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = call_loss(inputs, config)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    lazy, eager = eager_and_lazy(monkeypatch, inputs, config)
    assert torch.equal(lazy.loss, eager.loss)
    assert_same_floats(lazy.metrics, {k: float(v) for k, v in eager.metrics.items()})
    assert_same_floats(out.metrics, lazy.metrics)
