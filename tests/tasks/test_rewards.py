import threading

import pytest

from grpo_lab.tasks.data import (DATASET_NAMES, gsm8k_final_answer, load_gsm8k, load_sanity, load_task_dataset,
                                 to_grpo_dataset)
from grpo_lab.models.chat import QWEN_MATH_SYSTEM, render_qwen_math
from grpo_lab.tasks.rewards import grade, last_boxed, math_reward, wrap_latex


def test_last_boxed():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed(None) is None
    assert wrap_latex(r"\frac12") == r"$\frac12$" and wrap_latex("$x$") == "$x$"


def test_sanity_golds_grade_against_their_own_boxed_form(shared_data):
    ds = load_sanity(shared_data / "sanity_math_1460")
    assert len(ds) == 1460 and set(ds.column_names) == {"problem", "answer"}
    golds = ds["answer"]
    completions = [f"Reasoning... so the answer is $\\boxed{{{g}}}$." for g in golds]
    rewards = math_reward(completions, golds)
    assert rewards == [1.0] * len(golds)
    # a wrong answer fails
    assert math_reward([r"\boxed{1000003}"] * 200, golds[:200]) == [0.0] * 200
    ints = [g for g in golds if g.isdigit()][:100]
    shifted = [str(int(g) + 1) for g in ints]
    assert math_reward([f"\\boxed{{{s}}}" for s in shifted], ints) == [0.0] * len(ints)


def test_gsm8k_golds(shared_data):
    ds = load_gsm8k(shared_data / "gsm8k", split="test")
    assert len(ds) == 1319
    golds = ds["answer"][:300]
    assert math_reward([f"\\boxed{{{g}}}" for g in golds], golds) == [1.0] * 300
    assert gsm8k_final_answer("x\n#### 1,234") == "1234"
    assert load_gsm8k(shared_data / "gsm8k" / "train.jsonl").num_rows == 7473


def test_malformed_completions_score_zero_never_crash(shared_data):
    gold = load_sanity(shared_data / "sanity_math_1460")["answer"][:6]
    junk = ["", r"\boxed{", r"\boxed{}", r"\boxed{\frac{1}{", "}}}{{{", r"\boxed{\left(}", None, 42,
            [{"role": "assistant", "content": r"\boxed{\sqrt[}"}], r"\boxed{" + "(" * 500 + "}"]
    for g in gold:
        assert math_reward(junk, [g] * len(junk)) == [0.0] * len(junk)
    assert grade("1", None) == 0.0


def test_chat_completions_and_off_main_thread(shared_data):
    golds = load_sanity(shared_data / "sanity_math_1460")["answer"][:40]
    completions = [[{"role": "assistant", "content": f"\\boxed{{{g}}}"}] for g in golds]
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", math_reward(completions, golds)))
    t.start()
    t.join()
    assert out["r"] == [1.0] * 40


def test_prompts_and_loader_errors(shared_data):
    ds = to_grpo_dataset(load_sanity(shared_data / "sanity_math_1460").select(range(3)))
    assert ds[0]["prompt"][0] == {"role": "system", "content": QWEN_MATH_SYSTEM}
    assert ds[0]["prompt"][1]["role"] == "user"
    assert render_qwen_math("1+1").endswith("<|im_start|>assistant\n")
    assert "sanity" in DATASET_NAMES
    with pytest.raises(ValueError, match="Unknown dataset"):
        load_task_dataset("not-a-dataset")


def test_verl_layout_normalised(tmp_path):
    import datasets

    verl = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 1+1?"}],
                                        "reward_model": {"ground_truth": "2", "style": "rule"}}])
    verl.save_to_disk(str(tmp_path / "v"))
    ds = load_sanity(tmp_path / "v")
    assert ds[0] == {"problem": "What is 1+1?", "answer": "2"}


def test_a_list_of_answers_is_not_read_as_one_integer():
    """The integer fast path drops only thousands separators: '1,3' (two solutions) is not 13."""
    assert grade("13", "1,3") == 0.0 and grade("-18", "-1, 8") == 0.0 and grade("-21", "-2,1") == 0.0
    assert grade("1,3", "1,3") == 1.0
    assert grade("30951", "30,951") == 1.0 and grade("1,000,000", "1000000") == 1.0
