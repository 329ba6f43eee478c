"""The settings of `grpo-lab async-loop` and `grpo-lab serve-pool`, each declared once (TRL's `*_config.py` style).

Every field carries its default, its help and its rule; the command lines are generated from these dataclasses
(`settings_parser`), and `LoopConfig`, notebook 04's `QuickSettings` and `embedded_trainer_args` take their defaults
from the class attributes. What follows from a setting is a property computed from it, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..lab.settings import FileName, Range, SettingError, check_fields, setting
from ..loss.backends import DEFAULT_LOSS_BACKEND, LOGPROB_BACKENDS
from ..serving.adapters.slots import DEFAULT_MAX_STALENESS, max_loras_for
from ..serving.clusters.ray_placement import TRAINER_NODE_RESOURCE, parse_resources
from ..serving.clusters.ray_replicas import STRATEGIES as RAY_STRATEGIES
from .pool import DEFAULT_RUN_NAME, pool_name
from .tree_attention import CHOICES as TREE_ATTENTION_CHOICES

TRACKERS = ("none", "trackio", "tensorboard", "wandb")  # `--report-to`: transformers' integrations a run may log to
REPLICA_KINDS = ("cpu", "vllm")
LAUNCHERS = ("local", "ray")
POOL_RUNS_BY_DEFAULT = 3  # a pool's default adapter slots hold this many runs of the default max_staleness


def inflight_tasks(max_inflight_tasks: int, max_staleness: int, samples_per_step: int) -> int:
    """The rollout requests a run keeps in flight: `max_inflight_tasks` when set (> 0), else TRL 1.16's own default,
    `max(max_staleness, 1) × samples_per_step` (more would only produce samples that go stale before the trainer
    takes them; the floor of one step keeps `max_staleness=0` from stalling the worker). The one place the rule is
    written: the settings, the trainer's board, autotune and the doctor all ask here."""
    if max_inflight_tasks > 0:
        return max_inflight_tasks
    return max(max_staleness, 1) * samples_per_step


@dataclass(frozen=True)
class ResourceAmounts:
    """Ray resources: `NAME=AMOUNT[,NAME=AMOUNT...]` on the command line, or a mapping in a config file."""

    def problem(self, value) -> str | None:
        try:
            resource_amounts(value)
        except ValueError as error:
            return str(error)
        return None


def resource_amounts(value) -> dict[str, float]:
    """`{name: amount}` of a `ResourceAmounts` setting (`ray_placement.parse_resources`; ValueError when malformed)."""
    if isinstance(value, dict):
        value = ",".join(f"{name}={amount}" for name, amount in value.items())
    return parse_resources(value)


RUN, TRAINING, ASYNC, SERVING = "the run", "model and training", "asynchrony", "replicas and router"


@dataclass
class LoopSettings:
    """The settings of one async-loop run: the `grpo-lab async-loop` flags (each field is `--field-name`), also read
    from `--config file.yaml` (the field names as keys; flags given override it).

    Derived, never stored: `samples_per_step`, `inflight` (requests in flight), `adapter_slots` (`--max-loras` a
    replica needs), `pool_name` (the run's name on a shared pool), `trackers`.
    """

    output_dir: str = setting("runs/async-loop", group=RUN, help=(
        "folder of this run (checkpoints, metrics log, run.json, replica logs); it must be new or empty unless "
        "--resume or --overwrite"))
    resume: bool = setting(False, group=RUN, help="continue the run in --output-dir from its last complete checkpoint")
    overwrite: bool = setting(False, group=RUN, help="delete the run already in --output-dir and start over")
    max_steps: int = setting(20, group=RUN, check=Range(1), help=(
        "optimizer steps (global, counting the steps before a resume)"))
    save_steps: int = setting(10, group=RUN, check=Range(1), help="checkpoint every this many steps")
    seed: int = setting(0, group=RUN, check=Range(0), help="the run's seed")
    run_name: str = setting(DEFAULT_RUN_NAME, group=RUN, check=FileName(), help=(
        "the run's name: its results files (<run-name>.csv with --results-dir) and its run in the trackers "
        "(--report-to); also its name on a shared pool unless --pool-run gives another"))
    results_dir: str | None = setting(None, group=RUN, help="also write <run-name>.csv and its doctor verdict here")
    report_to: list[str] = setting(list, group=RUN, choices=TRACKERS, metavar="TRACKER", help=(
        f"also log the run to a tracker, through transformers' integration (repeatable; one of "
        f"{', '.join(TRACKERS)}; default none): trackio and tensorboard write locally"))
    checkpoint_storage: str | None = setting(None, group=RUN, metavar="URL", help=(
        "also publish every complete checkpoint here (e.g. s3://bucket/run/checkpoints); --resume on a fresh machine "
        "pulls the last complete one back"))

    model: str | None = setting(None, group=TRAINING, help=(
        "model directory, or a hub id when online (default: the embedded chat model)"))
    prompts_per_step: int = setting(2, group=TRAINING, check=Range(1), help="prompts per optimizer step")
    num_generations: int = setting(8, group=TRAINING, check=Range(2), help="rollouts per prompt (G)")
    learning_rate: float = setting(3e-3, group=TRAINING, check=Range(0.0, open=True), help="the LoRA learning rate")
    lora_rank: int = setting(1, group=TRAINING, check=Range(1), help=(
        "the LoRA rank r of the policy's adapter (alpha 2r, every linear layer); a shared pool's replicas take "
        "ranks up to their --max-lora-rank"))
    loss_backend: Literal[LOGPROB_BACKENDS] = setting(DEFAULT_LOSS_BACKEND, group=TRAINING, help=(
        "how the log-probs are computed (liger fuses its own loss and is not available here)"))
    tree_attention: Literal[TREE_ATTENTION_CHOICES] = setting("auto", group=TRAINING, help=(
        "attention over packed prefix-trie rows"))

    max_staleness: int = setting(DEFAULT_MAX_STALENESS, group=ASYNC, check=Range(0), help=(
        "how many policy versions old a sample may be when trained on"))
    max_inflight_tasks: int = setting(-1, group=ASYNC, check=Range(1, allow=(-1,)), help=(
        "rollout requests in flight; -1 is TRL's default, max(max_staleness, 1) x samples per step"))
    autotune: bool = setting(False, group=ASYNC, help=(
        "let the run turn its requests in flight and queue bound while it trains (grpo_lab.async_loop.autotune): "
        "each change is one line and an autotune/* metric"))
    queue_maxsize: int = setting(1024, group=ASYNC, check=Range(1), help=(
        "scored samples the rollout worker may queue ahead of the trainer (TRL's queue_maxsize)"))
    group_versions: bool = setting(True, group=ASYNC, help=(
        "(--no-group-versions) TRL's per-rollout policy versions instead of one version per prompt group"))
    rollout_failure_timeout: float = setting(120.0, group=ASYNC, check=Range(0.0, open=True), help=(
        "seconds of failing rollout requests before the run stops with an error"))

    replicas: int = setting(2, group=SERVING, check=Range(1), help="replicas to start")
    replica_kind: Literal[REPLICA_KINDS] = setting("cpu", group=SERVING, help=(
        "cpu: grpo_lab's CPU replica; vllm: real vLLM (on a CPU: bash scripts/vllm_cpu_env.sh)"))
    replica_threads: int = setting(1, group=SERVING, check=Range(1), help="torch threads per CPU replica")
    replica_url: list[str] = setting(list, group=SERVING, metavar="URL", help=(
        "a replica started elsewhere (repeatable): start only the router, in front of these"))
    router_url: str | None = setting(None, group=SERVING, metavar="URL", help=(
        "a router or vLLM server already running: start nothing"))
    port: int = setting(0, group=SERVING, check=Range(0, high=65535), help="the router's port (0: a free one)")
    pool_admin_key_file: str | None = setting(None, group=SERVING, metavar="FILE", help=(
        "with --router-url of a shared pool: the file `grpo-lab serve-pool` wrote its admin key to (default: "
        "$GRPO_LAB_POOL_ADMIN_KEY_FILE, then $GRPO_LAB_POOL_ADMIN_KEY)"))
    pool_run: str | None = setting(None, group=SERVING, metavar="NAME", help=(
        "the run's name on a shared pool (its token, adapter namespace and slots); default: --run-name"))
    run_weight: float = setting(1.0, group=SERVING, check=Range(0.0, open=True), help=(
        "on a shared pool: this run's fair share of the replicas against the others' weights"))
    launcher: Literal[LAUNCHERS] = setting("local", group=SERVING, help=(
        "local: replicas are child processes of this command; ray: replica actors placed over a Ray cluster's "
        "nodes and restarted by Ray (needs the `ray` extra)"))
    ray_address: str | None = setting(None, group=SERVING, metavar="ADDRESS", help=(
        "the Ray cluster for --launcher ray (auto, host:6379, ray://host:10001); default: start a local one"))
    replica_resources: str | None = setting(None, group=SERVING, metavar="NAME=AMOUNT[,...]",
                                            check=ResourceAmounts(), help=(
        "with --launcher ray: custom Ray resources each replica asks for, e.g. inference=1 (declared on the "
        "inference nodes with ray start --resources); only nodes that offer them get replicas"))
    replica_spread: Literal[RAY_STRATEGIES] = setting("SPREAD", group=SERVING, help=(
        "with --launcher ray: how the replicas spread over the nodes: SPREAD (over as many as it can), STRICT_SPREAD "
        "(a node each, or no start), PACK (as few as it can), STRICT_PACK (one node)"))
    replicas_on_trainer_node: bool = setting(False, group=SERVING, help=(
        f"with --launcher ray: let replicas use the node that declares the {TRAINER_NODE_RESOURCE} resource (ray "
        f"start --resources '{{\"{TRAINER_NODE_RESOURCE}\": 1}}'), by default kept free for the trainer"))
    adapter_storage: str | None = setting(None, group=SERVING, metavar="PATH_OR_URL", help=(
        "where adapter versions are published: a path or fsspec URL every replica can read "
        "(default <output-dir>/.vllm_lora)"))

    def __post_init__(self):
        check_fields(self)
        if self.router_url and self.replica_url:
            raise SettingError("router_url", "give either --router-url (a running router) or --replica-url "
                                             "(replicas to route to), not both")
        if self.launcher == "ray" and not self.starts_replicas:
            raise SettingError("launcher", "places the replicas the command starts: not with --router-url or "
                                           "--replica-url", flag="--launcher ray")
        ray_only = {"ray_address": bool(self.ray_address), "replica_resources": self.replica_resources is not None,
                    "replica_spread": self.replica_spread != LoopSettings.replica_spread,
                    "replicas_on_trainer_node": self.replicas_on_trainer_node}
        for name, given in ray_only.items():
            if given and self.launcher != "ray":
                raise SettingError(name, "only means something with --launcher ray")
        if self.pool_run is not None and not self.router_url:
            raise SettingError("pool_run", "is the run's name on a shared pool: give the pool's --router-url")

    @property
    def starts_replicas(self) -> bool:
        return not self.router_url and not self.replica_url

    @property
    def replica_resource_amounts(self) -> dict[str, float]:
        """`replica_resources` as Ray's `{name: amount}` (empty: none asked for)."""
        return resource_amounts(self.replica_resources) if self.replica_resources is not None else {}

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def inflight(self) -> int:
        """The requests in flight these settings give (`max_inflight_tasks`, or TRL's default for -1)."""
        return inflight_tasks(self.max_inflight_tasks, self.max_staleness, self.samples_per_step)

    @property
    def adapter_slots(self) -> int:
        """The adapter slots (`--max-loras`) a replica needs for this run (`max_staleness + 3`)."""
        return max_loras_for(self.max_staleness)

    @property
    def pool_name(self) -> str:
        """The run's name on a shared pool: `--pool-run`, else `--run-name` (the one rule: `pool.pool_name`)."""
        return pool_name(self.run_name, self.pool_run)[0]

    @property
    def trackers(self) -> list[str]:
        """`report_to` as TRL's list: each tracker once, "none" dropped."""
        return [name for name in dict.fromkeys(self.report_to) if name != "none"]

    def trainer_values(self) -> dict:
        """The `AsyncGRPOLabConfig` fields these settings set (`embedded_trainer_args` adds the embedded task's)."""
        return dict(
            max_steps=self.max_steps, per_device_train_batch_size=self.samples_per_step,
            num_generations=self.num_generations, learning_rate=self.learning_rate, max_staleness=self.max_staleness,
            max_inflight_tasks=self.max_inflight_tasks, queue_maxsize=self.queue_maxsize, save_steps=self.save_steps,
            seed=self.seed, loss_backend=self.loss_backend, tree_attention=self.tree_attention,
            group_consistent_versions=self.group_versions, rollout_failure_timeout_s=self.rollout_failure_timeout,
            adapter_storage=self.adapter_storage, checkpoint_storage=self.checkpoint_storage,
            report_to=self.trackers, run_name=self.run_name)


def like(name: str, **changes):
    """A `LoopSettings` field for another settings class: its default, help and rule unless `changes` say
    otherwise (`default=`, `help=`, `group=`)."""
    source = LoopSettings.__dataclass_fields__[name]
    metadata = {key: value for key, value in source.metadata.items() if key != "group"}
    default = changes.pop("default", source.default)
    return field(default=default, metadata={**metadata, **changes})


@dataclass
class PoolSettings:
    """The settings of a shared pool: the `grpo-lab serve-pool` flags (and `--config file.yaml`)."""

    replicas: int = like("replicas", help="replicas the runs share")
    replica_kind: Literal[REPLICA_KINDS] = like("replica_kind", help=(
        "grpo_lab's CPU replica, or real vLLM (its venv: $GRPO_LAB_VLLM_PYTHON)"))
    model: str | None = like("model", help="what the replicas serve (default: the embedded chat model)")
    adapter_slots: int = setting(POOL_RUNS_BY_DEFAULT * max_loras_for(DEFAULT_MAX_STALENESS),
                                 check=Range(max_loras_for(0)), help=(
        f"each replica's --max-loras, shared out between runs (max_staleness + 3 each; the default holds "
        f"{POOL_RUNS_BY_DEFAULT} runs of max_staleness {DEFAULT_MAX_STALENESS})"))
    max_lora_rank: int = setting(16, check=Range(1), help="largest LoRA rank a run may load")
    max_model_len: int = setting(128, check=Range(8), help="prompt + completion tokens a replica accepts")
    replica_threads: int = like("replica_threads")
    host: str = setting("127.0.0.1", help="where the router listens")
    port: int = like("port", default=8000)
    state_dir: str = setting("runs/pool", help="the pool's folder: admin.key, pool.json, replica logs")
    admin_key_file: str | None = setting(None, metavar="FILE", help=(
        "where to write the admin key (default <state-dir>/admin.key, mode 0600)"))
    run_lease: float = setting(120.0, check=Range(0.0, open=True), help=(
        "seconds without a request after which a run's adapters are reclaimed"))
    max_in_flight_per_replica: int | None = setting(None, check=Range(1), help=(
        "completions running per replica; beyond, they queue fairly per run (default: 4 for cpu, 64 for vllm)"))
    base_model: bool = setting(True, help="(--no-base-model) runs may complete with their own adapters only, not "
                                          "with the base model")

    def __post_init__(self):
        check_fields(self)
