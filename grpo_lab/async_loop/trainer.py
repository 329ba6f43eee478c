"""`AsyncGRPOLabTrainer`: TRL 1.16's `AsyncGRPOTrainer`, runnable on a CPU or any GPU offline, safe across kills.

What it changes and why, each measured on TRL 1.16.0, is the table of docs/async_loop.md ("The trainer");
autotune's live knobs (`live_knobs`) are turned between steps by `autotune.AutotuneCallback`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import time
from unittest import mock

from trl.experimental.async_grpo import async_grpo_trainer as trl_trainer
from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, save_lora_adapter

from ..loss import set_loss_backend
from ..serving.adapters.storage import AdapterStore, version_of
from . import preflight, tree_attention
from .autotune import AutotuneCallback, Autotuner, AutotuneConfig
from .config import AsyncGRPOLabConfig
from .live_knobs import LiveKnobs
from .control_client import BoundedVLLMClient
from .rollout_worker import LabRolloutWorker

log = logging.getLogger(__name__)


def _peak_flops_or_none(accelerator, dtype):
    """TRL's peak-FLOPs lookup, which only knows CUDA devices; None (no MFU metric) elsewhere."""
    if accelerator.device.type != "cuda":
        return None
    from trl.trainer.utils import get_peak_flops_per_device

    return get_peak_flops_per_device(accelerator, dtype)


class AsyncGRPOLabTrainer(AsyncGRPOTrainer):
    """TRL's `AsyncGRPOTrainer` for the grpo_lab loop (see the module docstring); same arguments, plus
    `adapter_store` (default: built from `args.adapter_storage`)."""

    def __init__(self, model: str, reward_funcs=None, args: AsyncGRPOLabConfig | None = None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, tools=None,
                 environment_factory=None, rollout_worker=None, weight_transfer=None,
                 adapter_store: AdapterStore | None = None, autotune=None):
        if args is None:
            args = AsyncGRPOLabConfig(output_dir=f"{str(model).rstrip('/').split('/')[-1]}-AsyncGRPO")
        elif not isinstance(args, AsyncGRPOLabConfig):
            raise TypeError("pass an AsyncGRPOLabConfig (TRL's AsyncGRPOConfig plus the loop's fields)")
        preflight.check_model(model)
        preflight.check_rewards(reward_funcs, tools, environment_factory)
        preflight.check_dataset(train_dataset, environment_factory)
        preflight.check_peft(peft_config, weight_transfer)
        if processing_class is None and os.path.isdir(model):
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(model, trust_remote_code=args.trust_remote_code)
        if processing_class is not None:
            preflight.check_tokenizer(processing_class)
        tree_attention.resolve(args.tree_attention, "cpu" if args.use_cpu else None)
        self.adapter_store = adapter_store or AdapterStore(
            args.adapter_storage or os.path.join(args.output_dir, ".vllm_lora"),
            replica_root=args.adapter_replica_root)
        client_cls = functools.partial(BoundedVLLMClient, control_timeout_s=args.control_timeout_s)
        if weight_transfer is None and rollout_worker is None:
            preflight.check_server(client_cls(args.vllm_server_base_url, args.vllm_server_timeout), peft_config,
                                   args.max_staleness)
        self.autotuner, knobs = _autotuner(autotune, args)
        worker_cls = functools.partial(LabRolloutWorker, max_staleness=args.max_staleness,
                                       group_consistent_versions=args.group_consistent_versions,
                                       rollout_failure_timeout_s=args.rollout_failure_timeout_s, live_knobs=knobs)
        with contextlib.ExitStack() as patches:
            patches.enter_context(mock.patch.object(trl_trainer, "get_peak_flops_per_device", _peak_flops_or_none))
            patches.enter_context(mock.patch.object(trl_trainer, "VLLMClient", client_cls))
            patches.enter_context(mock.patch.object(trl_trainer, "AsyncRolloutWorker", worker_cls))
            super().__init__(model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                             processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                             peft_config=peft_config, tools=tools, environment_factory=environment_factory,
                             rollout_worker=rollout_worker, weight_transfer=weight_transfer)
        if args.checkpoint_storage:  # each complete checkpoint also goes to the store, for a resume elsewhere
            from .checkpoint_store import CheckpointStore, PublishCheckpoints

            self.add_callback(PublishCheckpoints(CheckpointStore(args.checkpoint_storage)))
        if self.autotuner is not None:  # first at every log: the trackers and the metrics log see autotune/*
            self.autotune_callback = AutotuneCallback(self.autotuner, knobs)
            self.callback_handler.callbacks.insert(0, self.autotune_callback)
        self.tree_attention = tree_attention.install(self.accelerator.unwrap_model(self.model), args.tree_attention)
        set_loss_backend(self, args.loss_backend)
        self._reconciled = False
        self._live_versions: list[int] = []  # versions this process published that may still be requested
        self.published: list[dict] = []  # what this process published: name, version, digest, step

    # -- weight sync ----------------------------------------------------------------------------------------------
    def _reconcile_versions(self) -> int:
        """Before this process's first publish: the version to number on from, with the server cleared of
        adapters published before (by a killed run, or an earlier one)."""
        prefix = self._lora_name
        stored = self.adapter_store.highest_version(prefix)
        loaded = self.vllm_client.loaded_adapters()
        held = [v for v in (version_of(n, prefix) for n in loaded) if v is not None]
        base = max([self.model_version, stored, *held])
        for name in loaded:
            if version_of(name, prefix) is not None:
                self.vllm_client.unload_lora_adapter(name)
        for name in self.adapter_store.published_names():
            if version_of(name, prefix) is not None:
                self.adapter_store.delete(name)
        self.adapter_store.clean_staging()
        if base != self.model_version or held:
            log.warning("adapter versions up to v%d were published before this process (checkpoint at v%d); "
                        "unloaded %d from the server, numbering on from v%d", base, self.model_version, len(held),
                        base + 1)
        return base

    def _sync_weight_lora(self, t0: float) -> tuple[float, float, float]:
        """Publish the current adapter as a new version on shared storage, load it everywhere, retire old ones."""
        main = self.accelerator.is_main_process
        if main and not self._reconciled:
            self.model_version = self._reconcile_versions()
            self._reconciled = True
        version = self.model_version + 1
        name = f"{self._lora_name}-v{version}"
        model = self.accelerator.unwrap_model(self.model)
        staging = tempfile.mkdtemp(prefix="grpo-lab-adapter-") if main else None
        try:
            if main:
                self.vllm_client.pause()
            t_pause = time.time()
            self.accelerator.wait_for_everyone()
            t_barrier = time.time()
            # a collective: every rank gathers its shards, only the main process writes
            save_lora_adapter(model, self.accelerator, self._adapter_name,
                              os.path.join(staging or tempfile.gettempdir(), name))
            t_transfer = time.time()
            self.accelerator.wait_for_everyone()
            if main:
                try:
                    published = self.adapter_store.publish(os.path.join(staging, name), name, version=version,
                                                           step=self.state.global_step)
                    self.vllm_client.load_lora_adapter(name, self.adapter_store.replica_path(name))
                finally:
                    self.vllm_client.resume()  # never leave the replicas paused behind a failed sync
                self.published.append({"name": name, "version": version, "digest": published.digest,
                                       "step": self.state.global_step})
                # the worker moves on before the oldest version is unloaded: it tells a retired version's 404 from
                # a lost rollout by its own version (told after the unload, it judged that 404 against v(N-1),
                # where the retired version is still inside the window, and counted it lost)
                self.model_version = version
                if self.rollout_worker:
                    self.rollout_worker.update_model_version(version)
                self._retire(version)
        finally:
            if staging:
                shutil.rmtree(staging, ignore_errors=True)
        return t_pause, t_barrier, t_transfer

    def _retire(self, version: int) -> None:
        """Unload versions no sample can use any more (older than max_staleness); delete their files once the
        server no longer needs them (one sync later, and not while the router still drains them: vLLM may re-read
        an adapter's files while requests use it)."""
        self._live_versions.append(version)
        oldest_usable = version - self.args.max_staleness
        for old in [v for v in self._live_versions if v < oldest_usable]:
            self.vllm_client.unload_lora_adapter(f"{self._lora_name}-v{old}")
            self._live_versions.remove(old)
        old_names = [n for n in self.adapter_store.published_names()
                     if (v := version_of(n, self._lora_name)) is not None and v < oldest_usable - 1]
        if old_names:
            draining = self.vllm_client.draining_adapters() or set()
            for name in old_names:
                if name not in draining:
                    self.adapter_store.delete(name)


def _autotuner(autotune, args: AsyncGRPOLabConfig):
    """The controller and the worker's live knobs for `autotune` (None, False, True or an `AutotuneConfig`), starting
    from the run's own in-flight and queue settings."""
    if autotune is None or autotune is False:
        return None, None
    from .loop_settings import inflight_tasks

    config = AutotuneConfig() if autotune is True else autotune
    samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    start = inflight_tasks(args.max_inflight_tasks, args.max_staleness, samples_per_step)
    queue_bound = args.queue_maxsize if args.queue_maxsize > 0 else 1024
    tuner = Autotuner(config, start, queue_bound, args.num_generations, samples_per_step, args.max_staleness)
    b = tuner.bounds  # the worker starts from the tuner's values: a start beyond the pipeline budget is clamped
    return tuner, LiveKnobs(tuner.inflight, tuner.queue_bound, b.max_inflight, b.max_queue)


def loss_only_trainer(device: str = "cpu", epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                      gradient_accumulation_steps: int = 1) -> AsyncGRPOLabTrainer:
    """An `AsyncGRPOLabTrainer` holding just the state TRL's `compute_loss` reads: no model load, no server, no
    worker. For measuring or checking the loss step alone (benchmarks, tests); call `set_loss_backend` on it."""
    from collections import defaultdict

    from accelerate import Accelerator

    trainer = object.__new__(AsyncGRPOLabTrainer)
    trainer.accelerator = Accelerator(cpu=device == "cpu")
    trainer.aux_loss_enabled = False
    trainer.epsilon_low, trainer.epsilon_high = epsilon_low, epsilon_high
    trainer.current_gradient_accumulation_steps = gradient_accumulation_steps
    trainer._metrics = {"train": defaultdict(list)}
    for name in ("_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples",
                 "_step_forward_s"):
        setattr(trainer, name, 0.0)
    return trainer
