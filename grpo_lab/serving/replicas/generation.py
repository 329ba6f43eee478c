"""The CPU replica's engine: token-id generation with transformers + PEFT, runtime LoRA adapters, prefix reuse.

One request at a time, on one thread: this is the embedded stand-in that lets tests and notebooks run the async
GRPO path without a GPU, not a throughput engine. It follows vLLM's semantics where TRL depends on them: sampling
params, per-request seeds, logprobs of the sampled tokens after temperature and repetition penalty
("processed_logprobs", what TRL's importance-sampling correction assumes), an adapter *is* a model name, the last
prompt token is always recomputed, and pause (mode=keep) freezes generation between tokens.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from ...models.hf_compat import cache_keyword
from ..adapters.cache import AdapterCache, is_remote
from ..adapters.storage import ADAPTER_CONFIG, local_copy_matches, read_manifest
from ..routing.prefix_hash import block_hashes
from .lora_slot import AdapterFormatError, LoraSlot, LoraWeights
from .prefix_kv_cache import PrefixKVCache
from .config import CPUReplicaConfig


class RequestError(Exception):
    """A request vLLM would refuse; carries the HTTP status and vLLM-style message."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


CLIENT_CLOSED = "ClientClosed"


def _stop_if(aborted: Callable[[], bool]) -> None:
    if aborted():  # nginx's 499: nobody reads the answer
        raise RequestError(499, "the client closed the connection; the completion was cancelled", CLIENT_CLOSED)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False

    @classmethod
    def from_request(cls, body: dict) -> "SamplingParams":
        def num(name, kind=float, low=None, high=None):
            value = body.get(name)
            if value is None:  # absent or null: the field's default (n: 1)
                return getattr(cls, name, 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and
                                                                                  not isinstance(value, int)):
                raise RequestError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, "
                                        f"got {type(value).__name__}")
            if isinstance(value, float) and not math.isfinite(value):  # JSON parsers accept NaN and Infinity; no sampling parameter means them
                raise RequestError(400, f"'{name}' must be a finite number, got {value}")
            if (low is not None and value < low) or (high is not None and value > high):
                raise RequestError(400, f"'{name}' = {value} is out of range [{low}, {high}]")
            return kind(value)

        if num("n", int, 1) != 1:
            raise RequestError(400, "the CPU replica supports n=1 only (TRL sends one request per rollout)")
        return cls(max_tokens=num("max_tokens", int, 1), temperature=num("temperature", low=0.0),
                   top_p=num("top_p", low=1e-9, high=1.0), top_k=num("top_k", int, -1),
                   min_p=num("min_p", low=0.0, high=1.0), repetition_penalty=num("repetition_penalty", low=1e-9),
                   seed=num("seed", int, -(2**63), 2**63 - 1), logprobs=num("logprobs", int, 0, 20),
                   ignore_eos=bool(body.get("ignore_eos", False)))


def _load_base(config: CPUReplicaConfig):
    dtype = torch.float32 if config.dtype == "float32" else torch.bfloat16
    if os.path.isdir(config.model):
        return AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype)
    from ...models import build_model

    return build_model(config.model, dtype=dtype, seed=config.seed)


class Engine:
    def __init__(self, config: CPUReplicaConfig):
        torch.set_num_threads(config.torch_threads)
        self.config = config
        self.base = _load_base(config).eval()
        self.model = self.base  # the LoRA slot's PEFT model once an adapter is loaded (`lora_slot`)
        self.slot: LoraSlot | None = None
        self._cache_keyword = cache_keyword(self.base)
        self.adapters: dict[str, str] = {}  # name -> where it was loaded from
        self._weights: dict[str, LoraWeights] = {}
        self.cache = PrefixKVCache(config.prefix_cache_blocks, config.block_size)
        eos = self.base.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.vocab_size = self.base.config.vocab_size
        self.running = threading.Event()
        self.running.set()
        self._lock = threading.Lock()  # one user of the model at a time (generation, adapter changes)
        self._first_seen: dict[str, float] = {}
        self._adapter_cache = None  # local copies of adapters published on object stores, made at the first one
        self.generated_tokens = 0
        self.requests = 0
        self._active: str | None = None  # the model name whose weights fill the slot; None: unknown
        self.work_seconds: dict[str, float] = {}  # wall seconds per kind of work (`_timed`), for /metrics
        self.work_count: dict[str, int] = {}

    # -- adapters -------------------------------------------------------------------------------------------------
    def _visible(self, path: str) -> bool:
        if self.config.storage_lag_s > 0:
            first = self._first_seen.setdefault(path, time.monotonic())
            if time.monotonic() - first < self.config.storage_lag_s:
                return False
        return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))

    def _local_copy(self, name: str, url: str) -> str:
        """An adapter published on an object store (an fsspec URL): copied to this replica's cache and checked against
        its manifest; the load then reads the verified local copy. Not complete yet (no manifest) reads as vLLM's
        "No adapter found", which the router retries like a lagging mount."""
        if self._adapter_cache is None:
            self._adapter_cache = AdapterCache(self.config.adapter_cache_dir)
        try:
            return str(self._adapter_cache.materialize(name, url))
        except FileNotFoundError:
            raise RequestError(404, f"No adapter found for {url}", "NotFoundError") from None
        except (ValueError, OSError) as error:
            raise RequestError(400, f"could not fetch adapter {url}: {type(error).__name__}: {error}") from None

    def _forget_copy(self, name: str) -> None:
        if self._adapter_cache is not None:
            self._adapter_cache.release(name)

    def remove_adapter_copies(self) -> None:
        """Remove every local copy of an object-store adapter (the replica is shutting down)."""
        if self._adapter_cache is not None:
            self._adapter_cache.close()

    def _check_manifest(self, path: str) -> None:
        """A directory published by grpo_lab carries a manifest: refuse files that do not match it (a partial or
        corrupted copy would otherwise be served as the policy)."""
        try:
            files = read_manifest(path).get("files", {})
        except FileNotFoundError:
            return
        except (OSError, ValueError) as error:
            raise RequestError(400, f"unreadable adapter manifest in {path}: {error}") from None
        if not local_copy_matches(path, files):
            raise RequestError(400, f"{path} does not match its manifest")

    @contextlib.contextmanager
    def _timed(self, work: str):
        """Count `work` and the wall seconds it took: a shared pool's cost is replica time spent on adapters."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.work_seconds[work] = self.work_seconds.get(work, 0.0) + time.perf_counter() - started
            self.work_count[work] = self.work_count.get(work, 0) + 1

    def load_adapter(self, name: str, source: str) -> None:
        with self._timed("adapter_load"):
            if name in self.adapters or name in self.config.served_model_names:
                raise RequestError(400, f"The lora adapter '{name}' has already been loaded.")
            path = self._local_copy(name, source) if is_remote(source) else source.removeprefix("file://")
            try:
                self._load_local(name, path, source)
            except RequestError:
                if is_remote(source):
                    self._forget_copy(name)  # a copy nothing uses
                raise

    def _load_local(self, name: str, path: str, source: str) -> None:
        if not self._visible(path):
            raise RequestError(404, f"No adapter found for {source}", "NotFoundError")
        self._check_manifest(path)
        if len(self.adapters) >= self.config.max_loras:
            raise RequestError(400, f"cannot hold more than max_loras={self.config.max_loras} adapters; unload one")
        with self._lock:
            if self.slot is None:  # the first adapter: wrap the base once, for good
                self.slot = LoraSlot(self.base, self.config.max_lora_rank)
                self.model, self._active = self.slot.model, None
        try:
            weights = self.slot.read(path)  # a file read, not a change to the model: no lock
        except AdapterFormatError as error:
            raise RequestError(400, str(error)) from None
        with self._lock:
            self._weights[name] = weights
            self.adapters[name] = source

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise RequestError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        with self._timed("adapter_unload"), self._lock:
            del self.adapters[name], self._weights[name]
            if self._active == name:
                self._active = None
            self.cache.drop_namespace(name)
        self._forget_copy(name)

    # -- generation -----------------------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name not in self.adapters and name not in self.config.served_model_names:
            raise RequestError(404, f"The model `{name}` does not exist.", "NotFoundError")

    def _forward(self, ids: list[int], cache: DynamicCache) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True, **{self._cache_keyword: cache})
        return out.logits[0, -1].float()

    @torch.no_grad()
    def generate(self, model_name: str, prompt: list[int], params: SamplingParams,
                 aborted: Callable[[], bool] = lambda: False) -> dict:
        """One completion. `aborted()` is asked before prefill and between tokens: a request whose client has left
        (a router that cut it, a killed trainer) stops there, as vLLM aborts it, instead of generating for nobody."""
        self.check_model(model_name)
        if not prompt:
            raise RequestError(400, "the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise RequestError(400, f"token ids must be in [0, {self.vocab_size})")
        if len(prompt) + params.max_tokens > self.config.max_model_len:
            raise RequestError(400, f"This model's maximum context length is {self.config.max_model_len} tokens. "
                                    f"However, you requested {len(prompt) + params.max_tokens} tokens "
                                    f"({len(prompt)} in the messages, {params.max_tokens} in the completion).")
        generator = torch.Generator().manual_seed(params.seed if params.seed is not None else
                                                  int.from_bytes(os.urandom(7), "little"))
        hashes = block_hashes(prompt, model_name, self.config.block_size)
        with self._timed("generate"):
            return self._run(prompt, hashes, model_name, params, generator, aborted)

    @contextlib.contextmanager
    def _using(self, model_name: str):
        """Hold the model with `model_name` in the LoRA slot: an adapter's weights, or none for the base. The slot is
        filled when the name changes, not at every token."""
        with self._lock:
            if model_name not in self.adapters and model_name not in self.config.served_model_names:
                raise RequestError(404, f"The model `{model_name}` was unloaded during generation.", "NotFoundError")
            if self.slot is not None and self._active != model_name:
                self.slot.activate(self._weights.get(model_name))
                self._active = model_name
            yield

    def _run(self, prompt, hashes, namespace, params, generator, aborted) -> dict:
        self.running.wait()  # requests that arrive while paused wait before prefill
        _stop_if(aborted)
        self.requests += 1
        cache = DynamicCache(config=self.base.config)
        cached_blocks = self.cache.lookup(hashes)
        start = len(cached_blocks) * self.config.block_size
        for layer in range(len(cached_blocks[0]) if cached_blocks else 0):
            cache.update(torch.cat([b[layer][0] for b in cached_blocks], dim=2),
                         torch.cat([b[layer][1] for b in cached_blocks], dim=2), layer)
        with self._using(namespace):
            logits = self._forward(prompt[start:], cache)  # start < len(prompt): the last token is never cached
        if len(hashes) > len(cached_blocks):
            self.cache.store(namespace, hashes, [(l.keys, l.values) for l in cache.layers], len(cached_blocks))
        seen = list(prompt)
        out_ids, out_lps, top = [], [], []
        finish = "length"
        for step in range(params.max_tokens):
            token, logprob, top_lp = self._sample(logits, seen, params, generator)
            out_ids.append(token)
            out_lps.append(logprob)
            top.append(top_lp)
            seen.append(token)
            self.generated_tokens += 1
            if token in self.eos_ids and not params.ignore_eos:
                finish = "stop"
                break
            if step + 1 < params.max_tokens:
                self.running.wait()  # /pause?mode=keep freezes here, between tokens, holding no lock
                _stop_if(aborted)
                with self._using(namespace):
                    logits = self._forward([token], cache)
        return {"token_ids": out_ids, "logprobs": out_lps, "top_logprobs": top if params.logprobs else None,
                "finish_reason": finish, "cached_tokens": start}

    def _sample(self, logits: torch.Tensor, seen: list[int], p: SamplingParams, generator):
        logits = logits.clone()
        if p.repetition_penalty != 1.0:
            idx = torch.tensor(sorted(set(seen)))
            picked = logits[idx]
            logits[idx] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if p.temperature > 0:
            logits = logits / p.temperature
        logprobs = torch.log_softmax(logits, dim=-1)  # processed logprobs: after temperature and penalty
        if p.temperature == 0:
            token = int(torch.argmax(logits))
        else:
            masked = logits.clone()
            if p.top_k > 0 and p.top_k < masked.numel():
                kth = torch.topk(masked, p.top_k).values[-1]
                masked[masked < kth] = -float("inf")
            if p.top_p < 1.0:
                sorted_logits, order = torch.sort(masked, descending=True)
                probs = torch.softmax(sorted_logits, dim=-1)
                drop = probs.cumsum(-1) - probs > p.top_p
                masked[order[drop]] = -float("inf")
            if p.min_p > 0:
                probs = torch.softmax(masked, dim=-1)
                masked[probs < p.min_p * probs.max()] = -float("inf")
            token = int(torch.multinomial(torch.softmax(masked, dim=-1), 1, generator=generator))
        top_lp = None
        if p.logprobs:
            values, ids = torch.topk(logprobs, p.logprobs)
            top_lp = {str(int(i)): float(v) for v, i in zip(values, ids)}
        return token, float(logprobs[token]), top_lp
