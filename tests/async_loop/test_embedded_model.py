"""The embedded chat model: a saved directory every consumer loads, a chat template TRL parses, weights that know
the task some of the time (so GRPO has signal and a wrong adapter would be visible)."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab.tasks.embedded_model import chat_messages, embedded_model_dir, render_prompt, write_embedded_model
from grpo_lab.tasks.rewards import grade, last_boxed
from grpo_lab.tasks.tiny import addition_problems


def test_written_directory_loads_like_a_hub_model(tmp_path):
    path = write_embedded_model(tmp_path / "model")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # staging renamed away
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM's CPU attention needs head_dim >= 32
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok.apply_chat_template(chat_messages("12+34="), add_generation_prompt=True, return_dict=False)
    assert len(ids) == 25 and tok.decode(ids) == render_prompt(tok, "12+34=")
    assert model.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")

    from trl.chat_template_utils import add_response_schema, parse_response

    add_response_schema(tok)  # TRL knows the template, so the rollout worker can parse answers
    answer = tok("\\boxed{46}<|im_end|>", add_special_tokens=False)["input_ids"]
    assert parse_response(tok, answer, prefix=ids) == {"role": "assistant", "content": "\\boxed{46}"}


def test_weights_solve_addition_some_of_the_time():
    path = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    rows = addition_problems(seed=0)[0][:64]
    prompts = [render_prompt(tok, r["problem"]) for r in rows]
    batch = tok(prompts, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**batch, do_sample=True, temperature=1.0, max_new_tokens=8, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    rate = sum(grade(last_boxed(t), r["answer"]) for t, r in zip(texts, rows)) / len(rows)
    assert 0.2 <= rate <= 0.8, rate  # right some of the time: GRPO has signal
    greedy = model.generate(**batch, do_sample=False, max_new_tokens=8, pad_token_id=tok.pad_token_id)
    assert all(t.startswith("\\boxed{") for t in tok.batch_decode(greedy[:, batch["input_ids"].shape[1]:],
                                                                  skip_special_tokens=True))
