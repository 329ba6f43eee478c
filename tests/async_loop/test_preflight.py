"""What a new user gets wrong fails before any model load or process start, with a message that says what to do."""

import functools
import os

import pytest
from datasets import Dataset
from peft import LoraConfig

from grpo_lab.async_loop import preflight
from grpo_lab.async_loop.config import AsyncGRPOLabConfig
from grpo_lab.async_loop.trainer import AsyncGRPOLabTrainer
from grpo_lab.tasks.embedded_model import build_chat_tokenizer, embedded_model_dir
from grpo_lab.tasks.rewards import math_reward

GOOD_DATA = Dataset.from_list([{"prompt": [{"role": "user", "content": "12+34="}], "answer": "46"}])
LORA = LoraConfig(r=1, lora_alpha=2, target_modules="all-linear")


def args(tmp_path, **kw):
    return AsyncGRPOLabConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True,
                              vllm_server_base_url="http://127.0.0.1:9", vllm_server_timeout=1, **kw)


def build(tmp_path, **overrides):
    kwargs = dict(model=str(embedded_model_dir()), reward_funcs=math_reward, args=args(tmp_path),
                  train_dataset=GOOD_DATA, peft_config=LORA)
    kwargs.update(overrides)
    return AsyncGRPOLabTrainer(**kwargs)


def local_reward(completions, **kw):
    return [0.0] * len(completions)


@pytest.mark.parametrize("overrides, message", [
    (dict(reward_funcs=lambda completions, **kw: [0.0] * len(completions)), "cannot be sent to the rollout worker"),
    (dict(train_dataset=Dataset.from_list([{"prompt": "12+34=", "answer": "46"}])), "prompts must be chat messages"),
    (dict(train_dataset=Dataset.from_list([{"question": "12+34="}])), "needs a 'prompt' column"),
    (dict(peft_config=None), "peft_config=LoraConfig"),
    (dict(peft_config=LoraConfig(r=1, target_modules=["lm_head", "q_proj"])), "lm_head"),
    (dict(model="/nonexistent/model-dir"), "not a local directory"),
    (dict(reward_funcs=None), "no reward"),
])
def test_mistakes_fail_early_with_a_fix(tmp_path, overrides, message):
    with pytest.raises(preflight.PreflightError, match=message):
        build(tmp_path, **overrides)


def test_closure_rewards_are_refused_but_partials_pass():
    def closure(completions, **kw):
        return [0.0] * len(completions)

    with pytest.raises(preflight.PreflightError, match="module level"):
        preflight.check_rewards([closure])
    preflight.check_rewards([functools.partial(math_reward)])


def test_offline_hub_id_is_refused(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(preflight.PreflightError, match="Hub is offline"):
        preflight.check_model("Qwen/Qwen2.5-Math-1.5B")


def test_model_directory_without_config(tmp_path):
    with pytest.raises(preflight.PreflightError, match="config.json"):
        preflight.check_model(str(tmp_path))


def test_tokenizer_without_template_or_parser():
    tok = build_chat_tokenizer()
    preflight.check_tokenizer(tok)  # Qwen3's template: TRL parses it
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(preflight.PreflightError, match="response parser"):
        preflight.check_tokenizer(tok)
    tok.chat_template = None
    with pytest.raises(preflight.PreflightError, match="no chat template"):
        preflight.check_tokenizer(tok)


def test_unreachable_server_is_a_clear_error_in_bounded_time(tmp_path):
    """Nothing listens on port 9: the trainer says so within vllm_server_timeout, before loading the model."""
    import time

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="vLLM server at http://127.0.0.1:9"):
        build(tmp_path)
    assert time.monotonic() - t0 < 30


def test_config_fields():
    a = AsyncGRPOLabConfig(output_dir=os.devnull, report_to=[], use_cpu=True)
    assert a.bf16 is False  # the CPU replica serves float32; bf16 autocast here would skew the ratio
    assert a.tree_attention == "auto" and a.group_consistent_versions and a.loss_backend == "grpo_lab"
    with pytest.raises(ValueError, match="tree_attention"):
        AsyncGRPOLabConfig(output_dir=os.devnull, report_to=[], use_cpu=True, tree_attention="flash")
    with pytest.raises(ValueError, match="not available with AsyncGRPOTrainer"):
        AsyncGRPOLabConfig(output_dir=os.devnull, report_to=[], use_cpu=True, loss_backend="liger")
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncGRPOLabConfig(output_dir=os.devnull, report_to=[], use_cpu=True, max_staleness=-1)
