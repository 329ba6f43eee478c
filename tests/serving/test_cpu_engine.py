"""The CPU replica's engine in-process: sampling contract, prefix reuse, adapter lifecycle and status codes."""

from __future__ import annotations

import threading

import pytest

from grpo_lab.serving.replicas.generation import Engine, RequestError, SamplingParams
from grpo_lab.serving.replicas.config import CPUReplicaConfig


@pytest.fixture(scope="module")
def engine():
    return Engine(CPUReplicaConfig(served_model_names=["tiny-qwen3", "trl-policy-v0"], max_loras=2, max_lora_rank=8))


PROMPT = list(range(5, 45))


def test_seeded_sampling_is_reproducible_and_prefix_reuse_is_exact(engine):
    params = SamplingParams(max_tokens=6, seed=11)
    first = engine.generate("tiny-qwen3", PROMPT, params)
    again = engine.generate("tiny-qwen3", PROMPT, params)
    assert first["cached_tokens"] == 0 and again["cached_tokens"] == 32  # 39 cacheable tokens -> 2 blocks
    assert first["token_ids"] == again["token_ids"]
    assert first["logprobs"] == pytest.approx(again["logprobs"], abs=1e-5)
    other_name = engine.generate("trl-policy-v0", PROMPT, params)  # another namespace: no reuse
    assert other_name["cached_tokens"] == 0 and other_name["token_ids"] == first["token_ids"]


def test_greedy_and_params_validation(engine):
    out = engine.generate("tiny-qwen3", PROMPT, SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out["token_ids"]) <= 3
    for body, text in [({"max_tokens": "x"}, "max_tokens"), ({"n": 2}, "n=1"), ({"top_p": 0}, "top_p"),
                       ({"temperature": True}, "temperature")]:
        with pytest.raises(RequestError, match=text):
            SamplingParams.from_request(body)
    with pytest.raises(RequestError) as err:
        engine.generate("nope", PROMPT, SamplingParams())
    assert err.value.status == 404


def test_adapter_lifecycle_and_status_codes(engine, adapters, tmp_path):
    with pytest.raises(RequestError) as err:
        engine.load_adapter("a", str(tmp_path / "missing"))
    assert err.value.status == 404 and "No adapter found" in err.value.message
    engine.load_adapter("v1", adapters["trl-policy-v1"])
    with pytest.raises(RequestError) as err:
        engine.load_adapter("v1", adapters["trl-policy-v1"])
    assert err.value.status == 400 and "already been loaded" in err.value.message
    engine.load_adapter("v2", adapters["trl-policy-v2"])
    with pytest.raises(RequestError, match="max_loras"):
        engine.load_adapter("v3", adapters["trl-policy-v3"])
    params = SamplingParams(max_tokens=4, seed=3)
    base = engine.generate("tiny-qwen3", PROMPT, params)
    v1 = engine.generate("v1", PROMPT, params)
    assert v1["logprobs"] != base["logprobs"]
    engine.unload_adapter("v2")
    engine.unload_adapter("v1")  # the last one: the PEFT wrapper is dropped
    with pytest.raises(RequestError) as err:
        engine.unload_adapter("v1")
    assert err.value.status == 404
    assert engine.generate("tiny-qwen3", PROMPT, params)["logprobs"] == pytest.approx(base["logprobs"], abs=1e-5)
    engine.load_adapter("v1", adapters["trl-policy-v1"])  # and can be wrapped again
    assert engine.generate("v1", PROMPT, SamplingParams(max_tokens=4, seed=3))["token_ids"] == v1["token_ids"]
    engine.unload_adapter("v1")


def test_rank_above_max_is_refused(adapters, tmp_path):
    import json
    import shutil

    path = tmp_path / "big"
    shutil.copytree(adapters["trl-policy-v1"], path)
    config = json.loads((path / "adapter_config.json").read_text())
    config["r"] = 64
    (path / "adapter_config.json").write_text(json.dumps(config))
    small = Engine(CPUReplicaConfig(max_lora_rank=8, prefix_cache_blocks=0))
    with pytest.raises(RequestError, match="max_lora_rank"):
        small.load_adapter("big", str(path))


def test_pause_freezes_between_tokens(engine):
    engine.running.clear()
    result = {}
    worker = threading.Thread(target=lambda: result.update(engine.generate("tiny-qwen3", PROMPT,
                                                                          SamplingParams(max_tokens=3, seed=1))))
    worker.start()
    worker.join(timeout=0.5)
    assert worker.is_alive() and not result  # held while paused
    engine.running.set()
    worker.join(timeout=30)
    assert not worker.is_alive() and len(result["token_ids"]) <= 3


def test_prefix_cache_namespace_index_holds_only_cached_blocks():
    import torch

    from grpo_lab.serving.routing.prefix_hash import block_hashes
    from grpo_lab.serving.replicas.prefix_kv_cache import PrefixKVCache

    cache = PrefixKVCache(capacity_blocks=8, block_size=2)
    kv = [(torch.zeros(1, 1, 6, 1), torch.zeros(1, 1, 6, 1))]
    for p in range(200):  # two blocks per prompt, in two namespaces: far more than the cache holds
        for namespace in ("tiny-qwen3", "trl-policy-v1"):
            cache.store(namespace, block_hashes([p, p + 1, p + 2, 7, 7], namespace, 2), kv, 0)
    indexed = [h for names in cache._by_namespace.values() for h in names]
    assert len(cache) == 8 and sorted(indexed) == sorted(cache._blocks)  # evicted blocks are forgotten too
    cache.drop_namespace("trl-policy-v1")
    assert set(cache._by_namespace) == {"tiny-qwen3"} and len(cache) == len(cache._by_namespace["tiny-qwen3"])


def test_cache_keyword_follows_the_installed_transformers():
    """transformers renamed `past_key_values` to `cache`; an unknown keyword is swallowed by `**kwargs` and the
    caller's cache stays empty (every 16+-token prompt then failed on transformers 5.17, the GPU host's version)."""
    from grpo_lab.models.hf_compat import cache_keyword

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class New:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Wrapped:  # a PeftModel: the base model's signature decides
        def get_base_model(self):
            return Old()

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Wrapped()) == "past_key_values"


def test_the_engine_forward_fills_the_cache_it_passes(engine):
    from transformers import DynamicCache

    cache = DynamicCache(config=engine.base.config)
    engine._forward(PROMPT[:20], cache)
    assert all(layer.keys is not None and layer.keys.shape[2] == 20 for layer in cache.layers)


def test_adapter_names_with_dots_load_and_serve(engine, adapters):
    """vLLM serves any adapter name; a shared pool's run `lr0.001` names its adapters `lr0.001--trl-policy-v1`,
    which PEFT alone would refuse (a '.' is a module path)."""
    name = "lr0.001--trl-policy-v1"
    engine.load_adapter(name, adapters["trl-policy-v1"])
    try:
        params = SamplingParams(max_tokens=4, seed=3)
        dotted = engine.generate(name, PROMPT, params)
        assert dotted["logprobs"] != engine.generate("tiny-qwen3", PROMPT, params)["logprobs"]  # its weights, not base
    finally:
        engine.unload_adapter(name)
    assert name not in engine.adapters


def test_each_completion_uses_the_adapter_it_names_across_switches_loads_and_unloads(adapters):
    """The engine switches PEFT's active adapter only when the named one changes (a switch walks every module for
    every adapter held): interleaved requests, a load (which may make the new adapter active) and an unload of
    the active one must still each serve the adapter named."""
    engine = Engine(CPUReplicaConfig(served_model_names=["tiny-qwen3"], max_loras=3, max_lora_rank=8))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def logprobs(name):
        return engine.generate(name, PROMPT, params)["logprobs"]

    engine.load_adapter("v1", adapters["trl-policy-v1"])
    alone = {"v1": logprobs("v1"), "tiny-qwen3": logprobs("tiny-qwen3")}
    engine.load_adapter("v2", adapters["trl-policy-v2"])
    alone["v2"] = logprobs("v2")
    assert alone["v1"] != pytest.approx(alone["v2"], abs=1e-4)  # the adapters differ, so a mix-up would show
    for name in ("v1", "v2", "v2", "tiny-qwen3", "v1", "v2", "v1"):  # interleaved, as a shared pool sends them
        assert logprobs(name) == pytest.approx(alone[name], abs=1e-5), name
    engine.load_adapter("v3", adapters["trl-policy-v3"])  # a load between two uses of v2
    assert logprobs("v2") == pytest.approx(alone["v2"], abs=1e-5)
    engine.unload_adapter("v2")  # the active one goes: PEFT activates another
    assert logprobs("v1") == pytest.approx(alone["v1"], abs=1e-5)
    assert logprobs("v3") != pytest.approx(alone["v1"], abs=1e-4)
    assert logprobs("v1") == pytest.approx(alone["v1"], abs=1e-5)


def test_slot_serves_what_peft_computes_for_the_adapter(adapters):
    """The replica's one LoRA slot (`replicas.lora_slot`) must give the logprobs PEFT itself gives the same adapter,
    which is what the trainer computes its ratio against; here at a slot rank above the adapter's (zero-padded)."""
    import torch
    from peft import PeftModel

    from grpo_lab.models import build_model

    engine = Engine(CPUReplicaConfig(served_model_names=["tiny-qwen3"], max_loras=2, max_lora_rank=8))
    engine.load_adapter("v2", adapters["trl-policy-v2"])
    out = engine.generate("v2", PROMPT, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    reference = PeftModel.from_pretrained(build_model("tiny-qwen3"), adapters["trl-policy-v2"]).eval()
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([PROMPT + out["token_ids"]])).logits[0].float()
    expected = torch.log_softmax(logits[len(PROMPT) - 1:-1], -1).gather(1, torch.tensor(out["token_ids"])[:, None])
    assert out["token_ids"] == logits[len(PROMPT) - 1:-1].argmax(-1).tolist()
    assert out["logprobs"] == pytest.approx(expected[:, 0].tolist(), abs=1e-4)


def test_adapters_the_slot_cannot_serve_are_refused_with_400(adapters, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    engine = Engine(CPUReplicaConfig(served_model_names=["tiny-qwen3"], max_loras=4, max_lora_rank=8))

    def variant(name, config_change=None, tensors_change=None):
        folder = tmp_path / name
        shutil.copytree(adapters["trl-policy-v1"], folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **(config_change or {})}))
        if tensors_change:
            tensors = load_file(folder / "adapter_model.safetensors")
            tensors_change(tensors)
            save_file(tensors, folder / "adapter_model.safetensors")
        return str(folder)

    def extra_module(tensors):
        tensors["base_model.model.lm_head.lora_A.weight"] = next(iter(tensors.values())).clone()

    def wrong_shape(tensors):
        key = next(k for k in tensors if k.endswith("lora_A.weight"))
        tensors[key] = tensors[key].repeat(2, 1)

    for name, path, message in [
            ("dora", variant("dora", {"use_dora": True}), "use_dora"),
            ("alpha-pattern", variant("alpha-pattern", {"alpha_pattern": {"q_proj": 8}}), "alpha_pattern"),
            ("lm-head", variant("lm-head", tensors_change=extra_module), "lm_head"),
            ("shape", variant("shape", tensors_change=wrong_shape), "shapes"),
            ("rank", variant("rank", {"r": 16}), "max_lora_rank 8")]:
        with pytest.raises(RequestError, match=message) as err:
            engine.load_adapter(name, path)
        assert err.value.status == 400 and name not in engine.adapters
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 2}')
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RequestError, match="failed to load adapter") as err:
        engine.load_adapter("broken", str(tmp_path / "broken"))
    assert err.value.status == 400
    engine.load_adapter("fine", adapters["trl-policy-v1"])  # a refusal leaves the engine serving
    assert engine.generate("fine", PROMPT, SamplingParams(max_tokens=2))["token_ids"]
