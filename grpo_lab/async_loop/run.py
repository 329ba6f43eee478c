"""The body of `grpo-lab async-loop` once its settings passed the checks: prepare the run folder, run, report.

Split from `command` so that `grpo-lab async-loop --help` and every refused setting answer without importing torch
or TRL.
"""

from __future__ import annotations

import argparse
import sys
import time

from .checkpoints import checkpoint_step
from .launch import AsyncLoop, LoopConfig, embedded_trainer_args
from .progress import verdict_lines
from .run_dir import clear_previous_run, write_run_record


def trainer_args(a: argparse.Namespace):
    return embedded_trainer_args(
        a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=a.prompts_per_step * a.num_generations,
        num_generations=a.num_generations, learning_rate=a.learning_rate, max_staleness=a.max_staleness,
        max_inflight_tasks=a.max_inflight_tasks, save_steps=a.save_steps, tree_attention=a.tree_attention,
        loss_backend=a.loss_backend, group_consistent_versions=not a.no_group_versions,
        rollout_failure_timeout_s=a.rollout_failure_timeout, adapter_storage=a.adapter_storage,
        checkpoint_storage=a.checkpoint_storage, seed=a.seed, queue_maxsize=a.queue_maxsize,
        report_to=list(a.report_to), run_name=a.run_name)


def loop_config(a: argparse.Namespace) -> LoopConfig:
    return LoopConfig(replicas=a.replicas, replica_kind=a.replica_kind, router_url=a.router_url,
                      replica_urls=list(a.replica_url), router_port=a.port, launcher=a.launcher,
                      ray_address=a.ray_address, model=a.model,
                      replica_threads=a.replica_threads, autotune=a.autotune,
                      pool_run_name=a.run_name if getattr(a, "pool", None) is not None else None,
                      pool_weight=a.run_weight, pool_admin_key_file=a.pool_admin_key_file, pool_rejoin=a.resume)


def run_command(a: argparse.Namespace, t0: float, argv: list[str]) -> int:
    """Clear the old run (--overwrite) or say where the resume starts, train, then report and judge the run."""
    if a.overwrite:
        removed = clear_previous_run(a.output_dir)
        if removed:
            print(f"--overwrite: removed the previous run's {', '.join(removed)}", file=sys.stderr)
    resume = a.resume_from
    if resume is True:  # the newest complete checkpoint is on the store: make it a local one first
        from .checkpoint_store import pull_last_checkpoint

        resume = pull_last_checkpoint(a.checkpoint_storage, a.output_dir,
                                      lambda message: print(f"--resume: {message}", file=sys.stderr)).checkpoint
        print(f"--resume: pulled {resume} from {a.checkpoint_storage}", file=sys.stderr)
    start_step = checkpoint_step(resume) if resume else 0
    if resume:
        print(f"resuming from {resume} (metrics after step {start_step} are dropped: those steps run again)",
              file=sys.stderr, flush=True)
    args = trainer_args(a)
    loop = AsyncLoop(loop_config(a), args)
    with loop:
        loop.train(resume_from_checkpoint=resume)
        write_run_record(a.output_dir, {"command": ["grpo-lab", "async-loop", *argv]})
    steps = loop.trainer.state.global_step
    last = loop.trainer.published[-1]["name"] if loop.trainer.published else "nothing"
    origin = f", resumed from checkpoint-{start_step}" if resume else ""
    print(f"async loop done: step {steps}/{args.max_steps} ({steps - start_step} steps in this run{origin}) in "
          f"{time.perf_counter() - t0:.1f}s; last published {last}", flush=True)
    for line in verdict_lines(loop.verdict()):
        print(line, flush=True)
    if a.results_dir:
        from .results import write_run

        path = write_run(loop.recorder.rows, a.results_dir, a.run_name, a.max_staleness,
                         args.max_inflight_tasks if args.max_inflight_tasks > 0 else None,
                         extra={"replicas": a.replicas, "replica_kind": a.replica_kind,
                                "pool_run": a.run_name if getattr(a, "pool", None) is not None else "",
                                "tree_attention": loop.trainer.tree_attention,
                                "wall_s": round(time.perf_counter() - t0, 1)},
                         doctor=loop.doctor_config())
        print(f"wrote {path}", flush=True)
    return 0
