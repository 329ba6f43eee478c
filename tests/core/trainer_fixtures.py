"""A real (tiny, random-init) TRL GRPOTrainer built offline, for the core tests (a unique module name: several
test folders have a conftest.py, so `from conftest import ...` can pick up another folder's)."""

from datasets import Dataset
from trl import GRPOConfig

from grpo_lab.tasks.tiny import TinyModelConfig, build_tiny_model

TINY = TinyModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64, max_position_embeddings=64)


def digit_reward(completions, **kwargs):
    """Toy reward: the share of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def make_trainer(tmp_path, tokenizer, trainer_cls=None, model=None, seed=0, **config):
    from trl import GRPOTrainer

    trainer_cls = trainer_cls or GRPOTrainer
    args_cls = config.pop("args_cls", GRPOConfig)
    peft_config = config.pop("peft_config", None)
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
                    seed=seed, dataloader_num_workers=0)
    defaults.update(config)
    args = args_cls(**defaults)
    if model is None:
        # Saved to disk so TRL can load a reference model from the same path when beta != 0.
        model = str(tmp_path / f"tiny-{seed}")
        build_tiny_model(tokenizer, TINY, seed=seed).save_pretrained(model)
    dataset = Dataset.from_dict({"prompt": ["12+34=", "50+17=", "81+9=", "3+44="] * 4})
    return trainer_cls(model=model, reward_funcs=digit_reward, args=args, train_dataset=dataset,
                       processing_class=tokenizer, peft_config=peft_config)
