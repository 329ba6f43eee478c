import os
import subprocess
import sys
import textwrap

import pytest

from grpo_lab.tasks.data import load_sanity, to_grpo_dataset
from grpo_lab.tasks.recipe import RecipeConfig, check_prompts_fit
from grpo_lab.tasks.tiny import build_char_tokenizer


def test_recipe_defaults_are_the_seed_recipe():
    c = RecipeConfig().validate()
    assert c.model_name == "Qwen/Qwen2.5-Math-1.5B" and c.dataset == "sanity"
    assert (c.lora_r, c.lora_alpha, c.lora_target_modules) == (1, 2, "all-linear")
    assert (c.learning_rate, c.num_generations, c.completions_per_step) == (4e-5, 8, 128)
    assert (c.max_completion_length, c.max_context, c.beta) == (3000, 4096, 0.0)


@pytest.mark.parametrize("change, match", [
    (dict(lora_r=0), "lora_r must be >= 1"),
    (dict(num_generations=1), "num_generations"),
    (dict(dataset="imagenet"), "Unknown dataset"),
    (dict(completions_per_step=100), "multiple of num_generations"),
    (dict(max_completion_length=5000), "no room for a prompt"),
    (dict(loss_backend="fast"), "Unknown loss_backend"),
    (dict(micro_batch_size=0), "must be >= 1"),
    (dict(completions_per_step=0), "must be >= 1"),
])
def test_bad_recipe_configs(change, match):
    with pytest.raises(ValueError, match=match):
        RecipeConfig(**change).validate()


def test_prompt_longer_than_context(shared_data):
    ds = to_grpo_dataset(load_sanity(shared_data / "sanity_math_1460"))
    tok = build_char_tokenizer()  # one token per character: some Sanity prompts exceed 4096 - 3000
    with pytest.raises(ValueError, match="more than max_context - max_completion_length"):
        check_prompts_fit(tok, ds["prompt"], RecipeConfig())
    assert check_prompts_fit(tok, ds["prompt"][:50], RecipeConfig(max_context=16000)) > 0


def test_recipe_fails_early_and_clearly_offline(tmp_path, shared_data):
    code = textwrap.dedent(f"""
        import time
        t = time.time()
        from grpo_lab.tasks.recipe import RecipeConfig, RecipeUnavailableError, build_recipe_trainer
        try:
            build_recipe_trainer(RecipeConfig(dataset_path={str(shared_data / 'sanity_math_1460')!r}))
        except RecipeUnavailableError as e:
            print("CLEAR:", e)
            print("SECONDS", time.time() - t)
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "CLEAR:" in r.stdout, r.stdout + r.stderr
    assert "Qwen/Qwen2.5-Math-1.5B" in r.stdout and "HF_HUB_OFFLINE" in r.stdout
    assert float(r.stdout.split("SECONDS")[1]) < 60
