"""Loaders for the math datasets the recipes use, normalised to two columns: `problem` and `answer`.

Online, datasets load from the hub by name (`sail/Sanity-Test-R1D-1.5B` in its verl layout, `openai/gsm8k`,
`HuggingFaceH4/MATH-500`). Offline, pass `path=` to a local copy: a `datasets.load_from_disk` folder or a jsonl
file (tests read the shared copies in place through `shared_data_dir()`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets

from grpo_lab.lab import environment
from grpo_lab.models.chat import make_prompt

HUB_IDS = {
    "sanity": "sail/Sanity-Test-R1D-1.5B",
    "gsm8k": "openai/gsm8k",
    "math500": "HuggingFaceH4/MATH-500",
}
DATASET_NAMES = tuple(HUB_IDS)


def shared_data_dir() -> Path:
    """The shared offline copies: `$GRPO_LAB_SHARED_DATA`, else `<repo>/../shared/data`. Fails loudly if absent."""
    path = environment.shared_data_dir() or Path(__file__).resolve().parents[2].parent / "shared" / "data"
    if not path.is_dir():
        raise FileNotFoundError(
            f"Shared offline data not found at {path}. Set GRPO_LAB_SHARED_DATA to the folder holding "
            "sanity_math_1460/, math500/ and gsm8k/ (see shared/data/README.md), or load the datasets from the hub.")
    return path


def _local_or_hub(name: str, path, split: str) -> datasets.Dataset:
    """`split` of the `load_from_disk` copy at `path` (its first split when it has no such one), else the hub's."""
    if path is None:
        return datasets.load_dataset(HUB_IDS[name], split=split)
    obj = datasets.load_from_disk(str(path))
    if isinstance(obj, datasets.DatasetDict):
        return obj[split] if split in obj else obj[next(iter(obj))]
    return obj


def gsm8k_final_answer(solution: str) -> str:
    """The number after `####` in a GSM8K solution, without thousands separators."""
    if "####" not in solution:
        raise ValueError(f"Not a GSM8K solution (no '####'): {solution[:80]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _normalise_verl(ex: dict) -> dict:
    """verl layout (`prompt` chat list, `reward_model.ground_truth`) -> problem/answer."""
    prompt = ex["prompt"]
    if isinstance(prompt, list):
        user = [m["content"] for m in prompt if m.get("role") == "user"]
        problem = user[-1] if user else prompt[-1]["content"]
    else:
        problem = str(prompt)
    return {"problem": problem, "answer": str(ex["reward_model"]["ground_truth"])}


def load_sanity(path: str | os.PathLike | None = None, split: str = "train") -> datasets.Dataset:
    """The Sanity set (1,460 MATH problems, golds as bare LaTeX)."""
    ds = _local_or_hub("sanity", path, split)
    if "problem" not in ds.column_names:
        ds = ds.map(_normalise_verl, remove_columns=ds.column_names)
    return ds.select_columns(["problem", "answer"]).map(lambda ex: {"answer": str(ex["answer"])})


def load_math500(path: str | os.PathLike | None = None, split: str = "test") -> datasets.Dataset:
    return _local_or_hub("math500", path, split).select_columns(["problem", "answer"])


def load_gsm8k(path: str | os.PathLike | None = None, split: str = "train") -> datasets.Dataset:
    """GSM8K with `answer` reduced to the final number. `path`: a jsonl file or a folder holding `<split>.jsonl`."""
    if path is not None:
        path = Path(path)
        if path.is_dir():
            path = path / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        ds = datasets.Dataset.from_list(rows)
    else:
        ds = datasets.load_dataset(HUB_IDS["gsm8k"], "main", split=split)
    return ds.map(lambda ex: {"problem": ex["question"], "answer": gsm8k_final_answer(ex["answer"])},
                  remove_columns=ds.column_names)


_LOADERS = {"sanity": load_sanity, "gsm8k": load_gsm8k, "math500": load_math500}


def load_task_dataset(name: str, path=None, split: str | None = None) -> datasets.Dataset:
    """`name` in DATASET_NAMES; `path` a local copy (offline), else the hub."""
    if name not in _LOADERS:
        raise ValueError(f"Unknown dataset {name!r}; choose one of {DATASET_NAMES}.")
    kwargs = {} if split is None else {"split": split}
    return _LOADERS[name](path, **kwargs)


def to_grpo_dataset(ds: datasets.Dataset, prompt_format: str = "qwen_math") -> datasets.Dataset:
    """Add the `prompt` column TRL reads; `answer` is passed to the reward function as a keyword."""
    return ds.map(lambda ex: {"prompt": make_prompt(ex["problem"], prompt_format)})

