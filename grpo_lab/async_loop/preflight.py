"""Checks that run before the async trainer loads a model or starts a process, each failing with what to do.

Measured on TRL 1.16: a model given as a hub id offline, a tokenizer without a chat template or a response parser,
plain-string prompts, or a lambda reward all fail only after the model is loaded and the rollout worker spawned —
some as a worker that dies with a traceback in another process, some as a trainer waiting on an empty queue.
"""

from __future__ import annotations

import os
import pickle

from ..lab import environment
from ..serving.adapters.slots import max_loras_for, min_max_loras


class PreflightError(ValueError):
    """A configuration the async loop cannot run; the message says what to change."""


def check_model(model) -> None:
    if not isinstance(model, str):
        raise PreflightError(f"AsyncGRPOTrainer loads its model by path: pass a local directory (or a hub id when "
                             f"online), not a {type(model).__name__}. `grpo_lab.tasks.embedded_model.embedded_model_dir()` "
                             "is an offline default.")
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise PreflightError(f"{model} is a directory without config.json: save the model there with "
                                 "`model.save_pretrained(...)` (and its tokenizer with `save_pretrained`).")
        return
    if os.path.exists(model):
        raise PreflightError(f"{model} is a file; the model must be a directory saved with save_pretrained")
    offline = environment.hub_offline()
    if offline or model.startswith((".", "/", "~")):
        raise PreflightError(f"model {model!r} is not a local directory" + (
            " and the Hub is offline (HF_HUB_OFFLINE)" if offline else "") + ": pass a directory saved with "
            "save_pretrained; `grpo_lab.tasks.embedded_model.embedded_model_dir()` is an offline default.")


def check_tokenizer(tokenizer) -> None:
    """The rollout worker renders every prompt with the chat template and parses every answer."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise PreflightError("the tokenizer has no chat template: the async rollout worker renders every prompt with "
                             "`apply_chat_template`. Set `tokenizer.chat_template` (and save it with the model).")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        import copy

        from trl.chat_template_utils import add_response_schema

        try:
            add_response_schema(copy.copy(tokenizer))
        except ValueError as error:
            raise PreflightError(
                "TRL cannot parse the model's answers with this chat template (no response parser for it): use a "
                "template TRL knows (Qwen2.5/Qwen3/Llama 3.x, ...), or set `tokenizer.response_template` — see "
                f"transformers' chat response parsing docs. TRL said: {error}") from None


def check_rewards(reward_funcs, tools=None, environment_factory=None) -> None:
    """Everything the rollout worker receives is pickled into a spawned process."""
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    items = [(getattr(f, "__name__", repr(f)), f) for f in [*funcs, *(tools or [])] if f is not None]
    if environment_factory is not None:
        items.append(("environment_factory", environment_factory))
    for name, obj in items:
        try:
            pickle.dumps(obj)
        except Exception as error:  # noqa: BLE001 - any pickling failure means the same fix
            raise PreflightError(
                f"{name!r} cannot be sent to the rollout worker process ({type(error).__name__}: {error}): define it "
                "at module level (not a lambda or a closure), or wrap it with functools.partial.") from None
    if not items:
        raise PreflightError("no reward: pass reward_funcs (or an environment_factory whose environment defines "
                             "get_reward)")


def check_dataset(dataset, environment_factory=None) -> None:
    if dataset is None:
        if environment_factory is None:
            raise PreflightError("train_dataset is required unless an environment_factory owns the prompts")
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns:
        raise PreflightError(f"the dataset needs a 'prompt' column (has {columns})")
    try:
        first = dataset[0]["prompt"]
    except (IndexError, KeyError, TypeError):
        return  # streaming or empty: TRL reports it
    if isinstance(first, str):
        raise PreflightError("prompts must be chat messages, e.g. [{'role': 'user', 'content': '12+34='}]: the async "
                             "rollout worker renders each with the chat template (a plain string would be split "
                             "into characters)")
    if not (isinstance(first, list) and first and all(isinstance(m, dict) and "role" in m for m in first)):
        raise PreflightError(f"prompts must be lists of {{'role', 'content'}} messages; the first is {first!r:.120}")


def check_peft(peft_config, weight_transfer=None) -> None:
    """The loop syncs LoRA adapters (the router cannot fan out NCCL weight transfer)."""
    if weight_transfer is not None:
        return
    if peft_config is None:
        raise PreflightError("the grpo_lab async loop syncs the policy as LoRA adapters through shared storage: pass "
                             "peft_config=LoraConfig(...) (full-weight NCCL sync cannot go through the router)")
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise PreflightError(f"adapter-only sync needs a LoraConfig, got {type(peft_config).__name__}")
    if peft_config.use_dora or peft_config.modules_to_save or peft_config.bias != "none":
        raise PreflightError("vLLM serves plain LoRA deltas only: no DoRA, no modules_to_save, bias='none'")
    targets = peft_config.target_modules or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    if any("lm_head" in t or "embed_tokens" in t for t in targets):
        raise PreflightError("LoRA on lm_head / embed_tokens cannot be served as an adapter; target the linear "
                             "layers only (e.g. target_modules='all-linear')")


def check_server(client, peft_config, max_staleness: int) -> dict:
    """The server answers and can hold this run's adapters; returns its `vllm_config`."""
    client.wait_for_server_ready()
    info = client.get_server_info()
    lora = info.get("lora_config")
    if lora is None:
        raise PreflightError(f"the server at {client.server_url} was started without --enable-lora: adapter-only "
                             "sync needs it (start replicas with --enable-lora --max-lora-rank R --max-loras "
                             f"{max_loras_for(max_staleness)})")
    rank = max([peft_config.r, *peft_config.rank_pattern.values()]) if peft_config is not None else 0
    if lora.get("max_lora_rank", 0) < rank:
        raise PreflightError(f"the server's --max-lora-rank {lora.get('max_lora_rank')} is below the adapter rank "
                             f"{rank}")
    if lora.get("max_loras", 0) < min_max_loras(max_staleness):
        raise PreflightError(f"the server holds --max-loras {lora.get('max_loras')} adapters but max_staleness="
                             f"{max_staleness} needs {min_max_loras(max_staleness)}: restart it with --max-loras "
                             f"{max_loras_for(max_staleness)} (one slot more for the adapter the router drains) or "
                             "lower max_staleness")
    return info
