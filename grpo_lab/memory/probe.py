"""Run one memory point in fresh processes, so points cannot leak allocator state or fragmentation into each other.

One process per rank, forked from a fork server that has already imported torch/transformers/TRL (`_preload`, no
CUDA context), so a probe starts in about a second; ranks get the torchrun environment. Outcomes: `ok`, `oom` (also
a CPU budget overrun or a SIGKILL from the OOM killer) and `error` (`ProbeError`, with the child's traceback).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback

from grpo_lab.lab import environment

from .meter import is_oom_error
from .spec import PointSpec

NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class ProbeError(RuntimeError):
    """A probe failed for a reason other than memory: the search or sweep stops and shows it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_flat_head() -> None:
    """Measure the grpo_lab head on its memory-flat path (what runs at the memory limit), not with the [N, V]
    probabilities its memory policy keeps where memory is spare; a caller's `GRPO_LAB_MATERIALIZE_FRACTION` wins."""
    flat = environment.set_default("GRPO_LAB_MATERIALIZE_FRACTION", "0") == "0"
    tuning = sys.modules.get("grpo_lab.loss.kernel.tuning")
    if tuning is not None and flat:
        tuning.TUNING.materialize_fraction = 0.0


def _child(spec: PointSpec, rank: int, port: int, conn, capture_grads: bool) -> None:
    os.environ.update(NCCL_SAFE_ENV)
    if spec.extra.get("cuda_alloc_conf"):  # read by the caching allocator at its first use, after this
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = spec.extra["cuda_alloc_conf"]
    environment.set_default("TOKENIZERS_PARALLELISM", "false")
    environment.silence_trl_experimental()
    _memory_flat_head()
    distributed = spec.fsdp or spec.world_size > 1
    if distributed:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
                           "LOCAL_WORLD_SIZE": str(spec.world_size), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    else:
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            os.environ.pop(k, None)
    import torch

    if spec.device == "cpu" or (spec.device == "auto" and not torch.cuda.is_available()):
        # One intra-op thread by default: on small shared CPUs, thread contention costs far more than it gains
        torch.set_num_threads(environment.probe_threads())
        _return_freed_memory_to_os()
    import warnings

    warnings.filterwarnings("ignore")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        if spec.extra.get("fail"):  # test hook: a non-memory failure inside the probe
            raise RuntimeError(f"requested failure: {spec.extra['fail']}")
        with tempfile.TemporaryDirectory(prefix="grpo_lab_probe_") as out:
            if spec.mode == "loss":
                from .loss_probe import run_loss_probe

                result = run_loss_probe(spec)
            else:
                from .grpo_step import run_grpo_steps

                result = run_grpo_steps(spec, out, capture_grads=capture_grads)
        conn.send(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        status = "oom" if is_oom_error(exc) else "error"
        conn.send((status, f"{type(exc).__name__}: {exc}" if status == "oom" else traceback.format_exc()))
    finally:
        conn.close()
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


def _return_freed_memory_to_os() -> None:
    """glibc: serve every allocation above 64 KiB with mmap and return it on free, so the process's peak RSS tracks
    the peak of live tensors instead of what malloc kept cached (CPU probes only)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (also turns off the dynamic threshold)
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)


_CONTEXTS: dict[str, mp.context.BaseContext] = {}


def _context(start_method: str):
    if start_method not in _CONTEXTS:
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # the fork server inherits this: `torch.cuda.is_available()` then asks NVML and leaves CUDA uninitialised
            environment.set_default("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
            ctx.set_forkserver_preload(["grpo_lab.memory._preload"])
        _CONTEXTS[start_method] = ctx
    return _CONTEXTS[start_method]


def run_point(spec: PointSpec, timeout_s: float | None = None, start_method: str | None = None,
              capture_grads: bool = False, raise_on_error: bool = True) -> dict:
    """Measure `spec` in fresh processes; returns the result dict of rank 0 plus `status` (ok | oom | error) and
    `message`, and for multi-rank runs `per_rank`. Raises `ProbeError` on `error` unless `raise_on_error=False`.

    Should a forked probe ever find CUDA initialised by the fork server, the probe is retried once with "spawn", which
    then becomes the default for this process."""
    if timeout_s is None:  # a hung probe (e.g. a rank stuck in a collective) is an error after this long
        timeout_s = environment.probe_timeout_s()
    method = start_method or environment.probe_start_method()
    out = _run_point(spec, timeout_s, method, capture_grads)
    if out["status"] == "error" and method != "spawn" and "re-initialize CUDA in forked subprocess" in out["message"]:
        environment.set_probe_start_method("spawn")
        out = _run_point(spec, timeout_s, "spawn", capture_grads)
    if out["status"] == "error" and raise_on_error:
        raise ProbeError(f"probe {spec.as_dict()} failed:\n{out['message']}")
    return out


def _run_point(spec: PointSpec, timeout_s, start_method: str, capture_grads: bool) -> dict:
    ctx = _context(start_method)
    port = _free_port()
    procs, conns = [], []
    t0 = time.perf_counter()
    for rank in range(spec.world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(spec, rank, port, child_conn, capture_grads), daemon=False)
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)

    results: list[tuple[str, object] | None] = [None] * len(procs)
    deadline = t0 + timeout_s
    while None in results:
        for i, (p, c) in enumerate(zip(procs, conns)):
            if results[i] is None:
                if c.poll(0.05):
                    try:
                        results[i] = c.recv()
                    except EOFError:
                        results[i] = ("dead", None)
                elif not p.is_alive():
                    if c.poll(0.2):
                        continue
                    results[i] = ("dead", p.exitcode)
        now = time.perf_counter()
        if any(r is not None and r[0] != "ok" for r in results):
            deadline = min(deadline, now + 20)  # the other ranks may be stuck in a collective
        if now > deadline:
            break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    wall = time.perf_counter() - t0

    statuses = []
    for i, r in enumerate(results):
        if r is None:
            failed = any(x and x[0] != "ok" for x in results)
            statuses.append(("aborted", "stopped after a peer failed") if failed else ("error", "timed out"))
        elif r[0] == "dead":
            code = procs[i].exitcode if r[1] is None else r[1]
            if code == -9:  # SIGKILL: the kernel's OOM killer (nothing else here sends it to a running probe)
                statuses.append(("oom", f"rank {i} killed by signal 9 (out of host memory)"))
            else:
                statuses.append(("error", f"rank {i} exited with code {code} without a result"))
        else:
            statuses.append(r)
    kinds = {s[0] for s in statuses}
    status = "oom" if "oom" in kinds and "error" not in kinds else "ok" if kinds == {"ok"} else "error"
    out: dict = {"status": status, "wall_s": wall, "message": ""}
    if status == "ok":
        out.update(statuses[0][1])
        if spec.world_size > 1:
            out["per_rank"] = [s[1] for s in statuses]
            out["peak_bytes"] = max(s[1]["peak_bytes"] for s in statuses)
            out["reserved_bytes"] = max((s[1].get("reserved_bytes") or 0 for s in statuses), default=0) or None
    else:
        out["message"] = next(str(s[1]) for s in statuses if s[0] == status)
    return out
