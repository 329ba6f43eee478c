"""The whole async loop in one call: replicas, the router and the trainer over one storage root, torn down always.

`with AsyncLoop(LoopConfig(), embedded_trainer_args("runs/demo")) as loop: loop.train()` (docs/async_loop.md),
or `grpo-lab async-loop` (`command`). `LoopConfig` says what serves the rollouts: replicas this process
starts, replicas started elsewhere (`replica_urls`), a router already running (`router_url`), possibly a
shared pool the run joins as a tenant (`pool_run_name`). Replicas and the router are supervised children that
die with this process (even by SIGKILL); a normal exit, an exception, Ctrl-C and SIGTERM all stop every one of
them. An output directory holds one run (`run_dir`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..lab import environment
from ..lab.lifecycle import StartStop
from ..lab.settings import check_as
from ..serving.clusters.launcher import Cluster, ClusterSpec, GivenReplicas, LocalProcesses, RayActors
from ..serving.clusters.ray_placement import TRAINER_NODE_RESOURCE
from ..serving.replicas.vllm_spec import round_lora_rank
from .checkpoints import checkpoint_step, resume_checkpoint
from .loop_settings import LoopSettings, PoolSettings
from .run_dir import REPLICA_LOGS, RunDirError, holds_a_run, truncate_metrics, write_run_record
from .run_settings import run_settings

log = logging.getLogger(__name__)


# LoopConfig's fields that are command-line settings too, by their `LoopSettings` name: default and rule live there.
SETTINGS_NAMES = {**{name: name for name in ("replicas", "replica_kind", "router_url", "launcher", "ray_address",
                                             "model", "replica_threads", "pool_admin_key_file", "autotune",
                                             "replicas_on_trainer_node", "lora_rank")},
                  "replica_urls": "replica_url", "router_port": "port", "pool_run_name": "pool_run",
                  "pool_weight": "run_weight", "ray_strategy": "replica_spread"}


@dataclass
class LoopConfig:
    """What `AsyncLoop` starts around the trainer. The fields in `SETTINGS_NAMES` are `grpo-lab async-loop` flags,
    with `LoopSettings`' defaults, rules and help. The others: `ray_resources` (per replica actor, e.g.
    `{"inference": 1}`), `replica_host` (Ray replicas listen on each node's IP unless given), `max_model_len`,
    `ready_timeout_s`, `router` (extra `RouterConfig` fields), `replica_env`, `pool_rejoin` (take over a run of that
    name the pool still has: a resume). `model` None is the embedded chat model; `autotune` may be an
    `AutotuneConfig`."""

    replicas: int = LoopSettings.replicas
    replica_kind: str = LoopSettings.replica_kind
    router_url: str | None = LoopSettings.router_url
    replica_urls: list[str] = field(default_factory=list)
    router_port: int = LoopSettings.port
    launcher: str = LoopSettings.launcher
    ray_address: str | None = LoopSettings.ray_address
    ray_resources: dict = field(default_factory=dict)
    ray_strategy: str = LoopSettings.replica_spread
    replicas_on_trainer_node: bool = LoopSettings.replicas_on_trainer_node
    replica_host: str | None = None
    model: str | None = LoopSettings.model
    max_model_len: int = PoolSettings.max_model_len  # the embedded model's cap, as a pool's replicas
    replica_threads: int = LoopSettings.replica_threads
    ready_timeout_s: float = 180.0
    router: dict = field(default_factory=dict)
    replica_env: dict = field(default_factory=dict)
    pool_run_name: str | None = LoopSettings.pool_run
    pool_weight: float = LoopSettings.run_weight
    pool_admin_key_file: str | None = LoopSettings.pool_admin_key_file
    pool_rejoin: bool = False
    autotune: object = LoopSettings.autotune
    lora_rank: int = LoopSettings.lora_rank  # the adapter's rank when AsyncLoop is given no peft_config

    def __post_init__(self):
        """The shared fields' rules are `LoopSettings`' (checked there, named here); a pool run's name follows
        the pool's rule (`serving.tenancy.runs.check_run_name`)."""
        check_as(LoopSettings, self, SETTINGS_NAMES, skip=("autotune",))
        if self.pool_run_name is not None:
            from ..serving.tenancy.runs import check_run_name

            check_run_name(self.pool_run_name)

    @classmethod
    def from_settings(cls, settings: LoopSettings, joins_pool: bool = False) -> "LoopConfig":
        """The loop the command's settings describe; `joins_pool`: the router is a shared pool the run joins as
        `settings.pool_name` (a resume takes its old place back)."""
        values = {name: getattr(settings, setting) for name, setting in SETTINGS_NAMES.items()}
        values.update(replica_urls=list(settings.replica_url), pool_rejoin=settings.resume,
                      ray_resources=settings.replica_resource_amounts,
                      pool_run_name=settings.pool_name if joins_pool else None)
        return cls(**values)

    @property
    def starts_replicas(self) -> bool:
        return self.router_url is None and not self.replica_urls


def no_checkpointing() -> dict:
    """Activation checkpointing off, under the name this transformers knows (`activation_checkpointing` from 5.2x,
    `gradient_checkpointing` before, which newer versions deprecate)."""
    from transformers import TrainingArguments

    name = ("activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
            else "gradient_checkpointing")
    return {name: False}


def embedded_trainer_args(output_dir: str, settings: LoopSettings | None = None, **overrides):
    """`AsyncGRPOLabConfig` for the embedded task: the loop's settings (`LoopSettings`, its defaults when None: 2
    prompts x 8 rollouts a step, a LoRA-sized lr, ...) plus what the embedded task fixes (8-token completions,
    fixed-count rows, float32, one optimizer step per batch); `overrides` are trainer fields on top."""
    import torch

    from .config import AsyncGRPOLabConfig

    values = dict(
        output_dir=output_dir, **(settings or LoopSettings()).trainer_values(), gradient_accumulation_steps=1,
        max_completion_length=8, temperature=1.0, token_budget=0, **no_checkpointing(), logging_steps=1,
        save_strategy="steps", use_cpu=not torch.cuda.is_available(), vllm_server_timeout=120.0,
        bf16=False,  # the replicas serve the embedded model in float32; the IS ratio compares the two
        dataloader_num_workers=0, disable_tqdm=True)
    values.update(overrides)
    return AsyncGRPOLabConfig(**values)


def embedded_peft_config(r: int = LoopSettings.lora_rank):
    """The policy's LoRA adapter when none is given: rank `r`, alpha `2r`, on every linear layer."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")


@contextlib.contextmanager
def quiet_setup():
    """Building the trainer prints TRL's experimental-API warning, a deprecation TRL triggers inside transformers,
    TRL's own duplicate-callback warning and a weight-loading bar: none is the user's to act on."""
    import transformers

    environment.silence_trl_experimental()  # also for the spawned rollout worker
    level = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated.*", category=FutureWarning)
            yield
    finally:
        transformers.logging.set_verbosity(level)
        if bars:
            transformers.utils.logging.enable_progress_bar()


class AsyncLoop(StartStop):
    """Replicas + router + `AsyncGRPOLabTrainer`: `start()` (or `with`), `train()`, `stop()`. The trainer's arguments
    default to the embedded task; `args.vllm_server_base_url` is set to the router's URL. `progress` False (a
    notebook, which shows the live board) leaves out the progress bar. Without `peft_config` the policy's adapter
    is `embedded_peft_config(loop.lora_rank)`."""

    def __init__(self, loop: LoopConfig, args, reward_funcs=None, train_dataset=None, peft_config=None,
                 processing_class=None, callbacks=None, progress: bool = True):
        self.loop, self.args, self.progress = loop, args, progress
        self.reward_funcs, self.train_dataset = reward_funcs, train_dataset
        self.peft_config = peft_config if peft_config is not None else embedded_peft_config(loop.lora_rank)
        self.processing_class = processing_class
        self.callbacks = list(callbacks or [])
        self.cluster: Cluster | None = None  # the replicas this loop started (or was given) + its router
        self.trainer = None
        self.url: str | None = None
        self.seat = None  # pool.PoolSeat when the run joined a shared pool

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> "AsyncLoop":
        from .recorder import LoopRecorder

        model = self.loop.model
        if model is None:
            from ..tasks.embedded_model import embedded_model_dir

            model = str(embedded_model_dir())
        try:
            self.model = model
            self.url = self.loop.router_url or self._start_cluster(model)
            if self.loop.pool_run_name is not None:
                from .pool import PoolSeat

                self.seat = PoolSeat(self.url, self.loop.pool_run_name, self.args.max_staleness,
                                     self.loop.pool_weight, self.loop.pool_admin_key_file,
                                     rejoin=self.loop.pool_rejoin).join()
            self.args.vllm_server_base_url = self.url
            self.recorder = LoopRecorder(router_url=self.url)
            for callback in self.callbacks:  # a LoopBoard reads per-replica load from the router
                if getattr(callback, "router_url", "") is None:
                    callback.router_url = self.url
            with quiet_setup():  # the embedded task unless the caller gave its own
                from .embedded_task import REWARD_FUNCS, addition_dataset
                from .trainer import AsyncGRPOLabTrainer

                self.trainer = AsyncGRPOLabTrainer(
                    model, reward_funcs=self.reward_funcs or REWARD_FUNCS, args=self.args,
                    train_dataset=self.train_dataset if self.train_dataset is not None else addition_dataset(),
                    processing_class=self.processing_class, peft_config=self.peft_config,
                    callbacks=[self.recorder, *self.callbacks], autotune=self.loop.autotune)
            if self.trainer.autotuner is not None:  # each step's decisions go into its metrics row
                self.recorder.extras.append(self.trainer.autotune_callback.row_extra)
            if [t for t in (self.args.report_to or []) if t != "none"]:  # the router's figures in the trackers too
                from .trackers import RouterFigures

                self.trainer.callback_handler.callbacks.insert(0, RouterFigures(self.url))
            from transformers.trainer_callback import PrinterCallback, ProgressCallback

            self.trainer.remove_callback(PrinterCallback)  # a dict of 60 metrics per step buries the progress
            if self.progress:
                from .progress import LoopProgress

                self.trainer.remove_callback(ProgressCallback)
                self.trainer.add_callback(LoopProgress())
        except BaseException:
            self.stop()
            raise
        self._announce()
        return self

    def _start_cluster(self, model: str) -> str:
        """The replicas and router `LoopConfig` asks for, through the one launcher (`serving.clusters.launcher`):
        local child processes, Ray actors, or only a router in front of `replica_urls`."""
        loop = self.loop
        rank = round_lora_rank(max(self.peft_config.r, 1))
        spec = ClusterSpec(replicas=len(loop.replica_urls) or loop.replicas, kind=loop.replica_kind, model=model,
                           max_staleness=self.args.max_staleness, lora_rank=rank, max_model_len=loop.max_model_len,
                           replica_threads=loop.replica_threads, env=dict(loop.replica_env),
                           router={"port": loop.router_port, **loop.router}, log_dir=self.replica_log_dir)
        if loop.replica_urls:
            placement = GivenReplicas(loop.replica_urls)
        elif loop.launcher == "ray":
            placement = RayActors(address=loop.ray_address, resources=loop.ray_resources, strategy=loop.ray_strategy,
                                  host=loop.replica_host,
                                  avoid_resource=None if loop.replicas_on_trainer_node else TRAINER_NODE_RESOURCE)
        else:
            placement = LocalProcesses()
        # the router as a supervised child process, restarted on its port when it dies (docs/serving.md, "When
        # the router dies"); its state file and log beside the replicas' logs
        self.cluster = Cluster(spec, placement, router_dir=self.replica_log_dir)
        return self.cluster.start(timeout=loop.ready_timeout_s).url

    @property
    def replica_log_dir(self) -> str:
        """`<output_dir>/logs`: each replica's output, the place to look when a rollout fails with a 5xx."""
        path = os.path.join(os.path.abspath(self.args.output_dir), REPLICA_LOGS)
        os.makedirs(path, exist_ok=True)
        return path

    def _announce(self) -> None:
        out = os.path.abspath(self.args.output_dir)
        print(f"async loop: router {self.url} (metrics {self.url}/metrics, state {self.url}/router/state); "
              f"adapters {self.trainer.adapter_store.url}; metrics log {out}/loop_metrics.jsonl; "
              f"tree attention {self.trainer.tree_attention}; replica logs {self.replica_log_dir}"
              + (f"; run {self.seat.name} on a shared pool ({self.seat.slots} adapter slots per replica)"
                 if self.seat is not None else ""), flush=True)

    def train(self, resume_from_checkpoint=None):
        """`trainer.train`; `resume_from_checkpoint=True` is the last complete checkpoint (pulled from
        `checkpoint_storage` first where set), and the metrics log is cut back to its step. Without a resume, an
        output directory that already holds a run is refused (RunDirError): two runs would mix their files."""
        if resume_from_checkpoint is True:
            if self.args.checkpoint_storage:  # a fresh machine: the newest checkpoint may be on the store only
                from .checkpoint_store import pull_last_checkpoint

                pull_last_checkpoint(self.args.checkpoint_storage, self.args.output_dir, log.warning)
            resume_from_checkpoint = resume_checkpoint(self.args.output_dir, log.warning)
        if resume_from_checkpoint:
            truncate_metrics(self.args.output_dir, checkpoint_step(resume_from_checkpoint))
        elif holds_a_run(Path(self.args.output_dir)) and not self._fresh_record():
            raise RunDirError(f"{self.args.output_dir} already holds a run: resume it (resume_from_checkpoint=True) "
                              f"or use another folder")
        if self.trainer is None:
            self.start()
        write_run_record(self.args.output_dir, run_settings(self, resumed_from=resume_from_checkpoint))
        return self.trainer.train(resume_from_checkpoint=resume_from_checkpoint)

    def _fresh_record(self) -> bool:
        """Only what this loop's own start() wrote is there (replica logs, the adapter store's root)."""
        folder = Path(self.args.output_dir)
        return all(entry.name in (REPLICA_LOGS, ".vllm_lora") for entry in folder.iterdir())

    def verdict(self):
        """The doctor's verdict on this run so far, by its own settings (`run.json`) and its whole metrics log."""
        from .doctor import diagnose_run
        from .recorder import METRICS_FILE, read_metrics
        from .run_dir import read_run_record

        log_file = Path(self.args.output_dir) / METRICS_FILE
        rows = read_metrics(log_file) if log_file.is_file() else self.recorder.rows
        return diagnose_run(rows, read_run_record(self.args.output_dir) or {})

    def stop(self) -> None:
        worker = getattr(self.trainer, "rollout_worker", None) if self.trainer is not None else None
        if worker is not None:
            worker.stop()  # TRL stops it at the end of train(); this covers a start() that never trained
        if self.seat is not None:  # leave the shared pool: its adapters are unloaded there, its slots freed
            self.seat.leave()
            self.seat = None
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.stop()


