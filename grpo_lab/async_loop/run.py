"""The body of `grpo-lab async-loop` once its settings passed the checks: prepare the run folder, run, report.

Split from `command` so that `grpo-lab async-loop --help` and every refused setting answer without importing torch
or TRL.
"""

from __future__ import annotations

import sys
import time

from .checkpoints import checkpoint_step
from .doctor import DoctorConfig
from .launch import AsyncLoop, LoopConfig, embedded_trainer_args
from .loop_settings import LoopSettings
from .progress import verdict_lines
from .run_dir import clear_previous_run, write_run_record


def run_command(s: LoopSettings, found, t0: float, argv: list[str]) -> int:
    """Clear the old run (--overwrite) or say where the resume starts, train, then report and judge the run.
    `found` is what the checks found (`command.Checked`: the resume's checkpoint, the shared pool)."""
    if s.overwrite:
        removed = clear_previous_run(s.output_dir)
        if removed:
            print(f"--overwrite: removed the previous run's {', '.join(removed)}", file=sys.stderr)
    resume = found.resume_from
    if resume is True:  # the newest complete checkpoint is on the store: make it a local one first
        from .checkpoint_store import pull_last_checkpoint

        resume = pull_last_checkpoint(s.checkpoint_storage, s.output_dir,
                                      lambda message: print(f"--resume: {message}", file=sys.stderr)).checkpoint
        print(f"--resume: pulled {resume} from {s.checkpoint_storage}", file=sys.stderr)
    start_step = checkpoint_step(resume) if resume else 0
    if resume:
        print(f"resuming from {resume} (metrics after step {start_step} are dropped: those steps run again)",
              file=sys.stderr, flush=True)
    args = embedded_trainer_args(s.output_dir, settings=s)
    loop = AsyncLoop(LoopConfig.from_settings(s, joins_pool=found.pool is not None), args)
    with loop:
        loop.train(resume_from_checkpoint=resume)
        write_run_record(s.output_dir, {"command": ["grpo-lab", "async-loop", *argv]})
    steps = loop.trainer.state.global_step
    last = loop.trainer.published[-1]["name"] if loop.trainer.published else "nothing"
    origin = f", resumed from checkpoint-{start_step}" if resume else ""
    print(f"async loop done: step {steps}/{args.max_steps} ({steps - start_step} steps in this run{origin}) in "
          f"{time.perf_counter() - t0:.1f}s; last published {last}", flush=True)
    for line in verdict_lines(loop.verdict()):
        print(line, flush=True)
    if s.results_dir:
        from .results import write_run

        path = write_run(loop.recorder.rows, s.results_dir, s.run_name, s.max_staleness,
                         args.max_inflight_tasks if args.max_inflight_tasks > 0 else None,
                         extra={"replicas": s.replicas, "replica_kind": s.replica_kind,
                                "pool_run": loop.loop.pool_run_name or "",
                                "tree_attention": loop.trainer.tree_attention,
                                "wall_s": round(time.perf_counter() - t0, 1)},
                         doctor=DoctorConfig.for_replicas(s.replica_kind))
        print(f"wrote {path}", flush=True)
    return 0
