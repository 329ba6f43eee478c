"""Where a loss step's time goes that no GPU kernel accounts for (issue 45): the GPU's idle gaps in one step, each
put down to what the host was doing.

The floor ratio of a small or mid-sized head is set as much by the time the GPU waits as by its kernels
(`small_head_probe.py` measures the sum; this says where it lies). For each point and backend it prints the step's
CUDA-event time unprofiled (median of --reps), then profiles one step (torch.profiler, CPU + CUDA) and reads its
timeline back:
  - `busy`: kernels, copies and fills on the GPU; `idle`: the rest of the step;
  - the idle time by cause: `start` (before the first kernel: the host's prologue), `sync` (the host sat in a
    synchronising runtime call that returned inside the gap: the GPU had drained and waited for the host to queue
    more), `host` (the kernel after the gap was launched after the one before it had ended: the host fell behind),
    `device` (launched in time, started late: the GPU's own latency between kernels);
  - the host ops the `sync` and `host` gaps are spent in (the innermost operator around the late launch), summed;
  - the largest gaps, with the kernels on either side.
The profiler's own overhead lengthens host gaps, so read them against the unprofiled time: `wall − busy` there.
With --host-profile it also prints where the host's time goes per step, by Python function (cProfile over --reps
steps, own time first): the work before the head's first launch and between launches, which the GPU waits for when
nothing is queued (a blocking call such as an event wait shows there as its own time too).

    python benchmarks/step_timeline.py --points frozen:bf16:1024:8192,frozen:bf16:4096:8192 --backends grpo_lab,trl
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
import loss_bench  # noqa: E402  (the benchmark's harness: inputs, loss function, timer)

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
SYNC_CALLS = ("Synchronize", "cudaMemcpy", "cuMemcpy", "cudaHostAlloc", "cudaFreeHost", "cudaMalloc", "cudaFree")
STEP_LABEL = "step_timeline.step"


def _end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0.0)


def _innermost(ops: list[dict], tid, t: float) -> str:
    """Name of the shortest CPU operator of thread `tid` that spans time t, or '?'."""
    best = None
    for op in ops:
        if op.get("tid") == tid and op["ts"] <= t <= _end(op) and (best is None or op["dur"] < best["dur"]):
            best = op
    return best["name"] if best else "?"


def timeline(events: list[dict], min_gap_us: float = 2.0) -> dict:
    """The GPU timeline of one step from chrome-trace events (torch.profiler's export): busy and idle microseconds,
    the idle time by cause, the host operators it is spent in, and every gap of at least `min_gap_us`, largest
    first. Only the part after the `STEP_LABEL` annotation's start counts, when there is one."""
    step = [e for e in events if e.get("name") == STEP_LABEL and e.get("ph") == "X"]
    t0 = min((e["ts"] for e in step), default=None)
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X"
                  and (t0 is None or e["ts"] >= t0)), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    syncs = [e for e in events if e.get("cat") in LAUNCH_CATS and any(s in e["name"] for s in SYNC_CALLS)]
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X"
           and e.get("name") != STEP_LABEL]
    out = {"kernels": len(gpu), "busy_us": 0.0, "idle_us": 0.0, "by_cause": collections.Counter(),
           "by_host_op": collections.Counter(), "gaps": []}
    if not gpu:
        return out
    start = t0 if t0 is not None else gpu[0]["ts"]
    busy_until = start
    previous = None
    for e in gpu:
        gap = e["ts"] - busy_until
        if gap >= min_gap_us:
            cause, where = _cause(previous, e, busy_until, launches, syncs, ops)
            out["by_cause"][cause] += gap
            if cause in ("sync", "host"):
                out["by_host_op"][where] += gap
            out["gaps"].append({"us": gap, "cause": cause, "where": where,
                                "before": previous["name"] if previous else "(step start)", "after": e["name"]})
        if gap > 0:
            out["idle_us"] += gap
        out["busy_us"] += max(0.0, _end(e) - max(e["ts"], busy_until))
        busy_until = max(busy_until, _end(e))
        previous = e
    out["gaps"].sort(key=lambda g: -g["us"])
    return out


def _cause(previous, kernel, idle_from, launches, syncs, ops) -> tuple[str, str]:
    """(cause, host operator) of the idle time before `kernel`, which began at `idle_from`."""
    launch = launches.get(kernel.get("args", {}).get("correlation"))
    if previous is None:
        return "start", _innermost(ops, launch["tid"], launch["ts"]) if launch else "?"
    if launch is None:
        return "unknown", "?"
    if launch["ts"] < idle_from:
        return "device", ""
    blocked = [s for s in syncs if s.get("tid") == launch["tid"] and idle_from <= _end(s) <= launch["ts"]]
    if blocked:
        last = max(blocked, key=_end)
        return "sync", f"{_innermost(ops, last['tid'], last['ts'])} ({last['name']})"
    return "host", _innermost(ops, launch["tid"], launch["ts"])


def profile_step(step) -> list[dict]:
    """Chrome-trace events of one call of `step` under torch.profiler (CPU, and CUDA when there is one)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with record_function(STEP_LABEL):
            step()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def host_profile(step, reps: int, top: int) -> list[str]:
    """The host's time per step by Python function, own time first (cProfile over `reps` calls of `step`)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, function): (primitive calls, calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = [f"    host per step: {sum(v[2] for v in stats.values()) / reps * 1000:.3f} ms in Python and the calls it "
             f"makes"]
    for (path, line, name), (_, calls, own, cumulative, _) in rows:
        lines.append(f"    host fn {own / reps * 1000:7.3f} ms own {cumulative / reps * 1000:7.3f} ms cum "
                     f"{calls / reps:6.1f}/step  {os.path.basename(path)}:{line} {name}"[:150])
    return lines


def report(name: str, wall_ms: float, tl: dict, top: int) -> list[str]:
    busy, idle = tl["busy_us"] / 1000, tl["idle_us"] / 1000
    causes = ", ".join(f"{k} {v / 1000:.3f}" for k, v in tl["by_cause"].most_common())
    lines = [(f"{name}: {wall_ms:.3f} ms a step unprofiled; profiled: busy {busy:.3f} ms in {tl['kernels']} kernels, "
              f"idle {idle:.3f} ms ({causes})")]
    for op, us in tl["by_host_op"].most_common(top):
        lines.append(f"    host op {us / 1000:7.3f} ms  {op}")
    for g in tl["gaps"][:top]:
        lines.append(f"    gap {g['us']:8.1f} us  {g['cause']:7s} {g['where'][:60]:60s} {g['before'][:40]} -> "
                     f"{g['after'][:40]}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="frozen:bf16:1024:8192,frozen:bf16:4096:8192,frozen:bf16:1024:32768",
                   help="head:dtype:H:tokens[:T],... (as loss_bench.py --points)")
    p.add_argument("--backends", default="grpo_lab,trl", help="of loss_bench's backends")
    p.add_argument("--reps", type=int, default=10, help="unprofiled timed steps per point and backend")
    p.add_argument("--top", type=int, default=8, help="host operators and gaps listed per step")
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=loss_bench.V, help="vocabulary size (smaller only for smoke runs)")
    p.add_argument("--host-profile", action="store_true",
                   help="also the host's time per step by Python function (cProfile over --reps steps)")
    p.add_argument("--out", default="", help="append the report to OUT/step_timeline.txt")
    args = p.parse_args(argv)
    loss_bench.V = args.vocab
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    config = loss_bench.dapo_config()
    lines = []
    for head, dname, hdim, tokens, seq in loss_bench.parse_points(args.points):
        data = loss_bench.make_inputs(loss_bench.DTYPES[dname], hdim, tokens, seq, device, seed=hdim + tokens)
        hidden, weight, ids, mask, adv = data
        hidden = hidden.detach().requires_grad_()
        weight = weight.detach().requires_grad_(head == "trainable")
        for backend in args.backends.split(","):
            fn = loss_bench.make_loss_fn(backend, config)

            def step():
                hidden.grad = weight.grad = None
                fn(hidden, weight, ids, mask, adv).backward()

            with loss_bench.backend_settings(backend):
                step()
                step()
                wall = statistics.median(loss_bench.timer(step, args.reps, device))
                tl = timeline(profile_step(step))
                hosts = host_profile(step, args.reps, 3 * args.top) if args.host_profile else []
            block = report(f"{backend} {head} {dname} H={hdim} N={tokens}", wall, tl, args.top) + hosts
            print("\n".join(block), flush=True)
            lines += block
        del data, hidden, weight
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "step_timeline.txt"), "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
