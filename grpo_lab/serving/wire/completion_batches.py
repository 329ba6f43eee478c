"""A `/v1/completions` request as vLLM reads it, for a router that sends each prompt of a batch on its own.

vLLM takes a prompt as token ids, a string, or a batch of either, and answers a batch with one completion whose
choices follow the prompts. The router splits a batch so that each prompt is routed by its own prefix, so it must
refuse what vLLM refuses (with vLLM's message, kind and field), and merge the answers the way vLLM builds one.
"""

from __future__ import annotations

from .upstream import Reply

MAX_COMPLETION_PROMPTS = 1024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS default
EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."


def _token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


class PromptError(ValueError):
    """A `prompt` vLLM refuses; `kind`/`param` as vLLM reports it ("Bad Request" and the field's path for what its
    request schema rejects)."""

    def __init__(self, message: str, kind: str = "BadRequestError", param: str = "prompt"):
        super().__init__(message)
        self.kind, self.param = kind, param


def split_prompt(prompt) -> list:
    """vLLM's accepted `prompt` forms: token ids, a string, or a batch (list of token-id lists, or of strings), as
    a list of prompts; raises PromptError with vLLM's message for what vLLM refuses."""
    if prompt is None or prompt == "":
        raise PromptError(EMPTY_PROMPT)
    if isinstance(prompt, str) or _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_token_ids(p) for p in prompt)):
        if len(prompt) > MAX_COMPLETION_PROMPTS:
            raise PromptError(f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                              f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS "
                              "environment variable.")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next(i for i, t in enumerate(prompt) if t < 0)  # vLLM's schema: token ids are non-negative
        raise PromptError(f"Input should be greater than or equal to 0 (prompt[{bad}] = {prompt[bad]})",
                          "Bad Request", f"body.prompt.{bad}")
    raise PromptError("'prompt' must be a string, a list of non-negative token ids, or a batch of either")


def merge_batch(answers: list[dict]) -> dict:
    """One completion answer for a batch, as vLLM builds it: choices in prompt order, re-indexed, usage summed
    (`prompt_tokens_details` from the last prompt, as vLLM reports it)."""
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for answer in answers:
        for choice in answer.get("choices", []):
            choices.append({**choice, "index": len(choices)})
        for key in usage:
            usage[key] += int((answer.get("usage") or {}).get(key, 0) or 0)
    details = (answers[-1].get("usage") or {}).get("prompt_tokens_details") if answers else None
    if details is not None:
        usage["prompt_tokens_details"] = details
    return {**answers[0], "choices": choices, "usage": usage}


def completion_json(reply: Reply) -> dict | None:
    """The parsed body of a 200 completion, or None when it is not a completion (malformed, truncated, other)."""
    body = reply.json()
    return body if isinstance(body, dict) and isinstance(body.get("choices"), list) else None
