"""The largest per-device GRPO batch that fits, by exponential then binary search, each probe in fresh processes.

    python -m grpo_lab.memory.max_batch --quick --out results/fsdp_max_batch   # CPU, gloo, tiny models
    python -m grpo_lab.memory.max_batch --full  --out results/fsdp_max_batch   # one H200: Qwen3 0.6B-8B, bf16 LoRA
    # --full writes fsdp_max_batch_expandable.csv (expandable_segments); with --default-allocator, fsdp_max_batch.csv

A probe is `spec.steps` real TRL GRPO optimizer steps (FSDP2 + LoRA, `grpo_step`) at one batch size; it fits when
every rank finishes within `budget` (CUDA: a memory fraction; CPU: peak RSS above the baseline). Any other failure
stops the search. How the search picks its probes: `search_max_batch`; docs/memory.md.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..lab.records import run_record
from ..loss.backends import DISPLAY_ORDER, LOGPROB_BACKENDS, in_display_order, resolve_backend
from .probe import ProbeError, run_point
from .results import (COLUMNS, ENV_COLUMNS, GiB, cli_error, make_row, ratio_table, target_csv, text_column,
                      write_csv)
from .spec import (
    EXPANDABLE_SEGMENTS,
    PointSpec,
    check_model,
    check_positive_int,
    normalize_dtype,
    parse_str_list,
    require_liger_if_named,
)

FIGURE = "fsdp_max_batch"

PRESETS = {
    # CPU: FSDP2 over a 1-process gloo group (the 2-process run is in the tests), LoRA r=8, small-qwen3 (vocab
    # 8192, so the logits matter); a budget 0.03 GiB above what one sequence needs, so the limit is reached at a few
    # sequences whatever fixed RSS the Python environment adds (measured: 0.11 GiB in one venv, 0.15 in another)
    "quick": dict(models=["small-qwen3"], backends=in_display_order(LOGPROB_BACKENDS), dtype="fp32",
                  prompt_len=8, completion_len=24, world_size=1, lora_r=8, budget_above_one_gib=0.03, start=4, upper=32,
                  rel_tol=0.25, steps=1, device="cpu"),
    # One H200 (world size 1), bf16 LoRA r=16, 256 prompt + 512 completion tokens, the whole GPU as budget, probes
    # under expandable_segments (the allocator setting the memory planner's max batch is validated for; 7-19 % more
    # batch for the fused heads than the default allocator, results/fsdp_max_batch/H200_RUN.md)
    "full": dict(models=["Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B"], backends=list(DISPLAY_ORDER),
                 dtype="bf16", prompt_len=256, completion_len=512, world_size=1, lora_r=16, budget_fraction=None,
                 start=8, upper=1024, rel_tol=0.03, steps=1, device="cuda", expandable_segments=True),
}
# the command line's flags over a preset's fields (type of each), and the few that need a word of help
PRESET_FLAGS = {"models": str, "backends": str, "dtype": str, "prompt_len": int, "completion_len": int,
                "world_size": int, "lora_r": int, "budget_gib": float, "budget_fraction": float, "start": int,
                "upper": int, "rel_tol": float, "steps": int}
PRESET_HELP = {"world_size": "processes (GPUs of one host); probes launch them",
               "budget_fraction": "fraction of the GPU's memory (CUDA)"}


@dataclass
class SearchResult:
    max_batch: int  # largest batch that fitted (0: not even 1)
    first_oom: int | None  # smallest batch that did not fit (None: never hit)
    capped: bool  # stopped at `upper` with everything fitting
    probes: list[tuple[int, str]] = field(default_factory=list)  # (batch, ok|oom) in probe order, resumed ones first
    results: dict[int, dict] = field(default_factory=dict)
    incomplete: bool = False  # stopped by `out_of_time` before the gap was closed (max_batch, first_oom: the bracket)
    resumed: int = 0  # earlier probes it started from


def _footprint(r: dict) -> float:
    """What a probe needed from the device: the allocator's reserved peak when known (that is what must fit; it
    sat 7-35 % above the allocated peak of the fused backends at large batch on the H200), else the allocated/RSS peak."""
    return max(r.get("reserved_bytes") or 0, r["peak_bytes"]) - r.get("base_bytes", 0)


def linear_guess(results: dict[int, dict], budget: float | None) -> int | None:
    """Largest B with setup + B × per-sequence ≤ budget, from the fitted probes' footprints (None if not estimable).

    The line goes through the smallest and largest fitted probes (the reserved peak moves in allocator-segment
    steps, so close probes give a noisy slope); from one probe, (peak − setup) / B overestimates the slope, so the
    first guess lands low and fits."""
    if not budget:
        return None
    pts = sorted((b, _footprint(r), r.get("setup_bytes", 0) - r.get("base_bytes", 0))
                 for b, r in results.items() if r.get("status") == "ok" and r.get("peak_bytes"))
    if not pts:
        return None
    if len(pts) >= 2:
        (b1, p1, _), (b2, p2, _) = pts[0], pts[-1]
        per = (p2 - p1) / (b2 - b1)
        intercept = p2 - per * b2
    else:
        b, p, setup = pts[-1]
        per = (p - setup) / b
        intercept = setup
    if per <= 0:
        return None
    return max(1, int((budget - intercept) / per))


def search_max_batch(fits: Callable[[int], tuple[bool, dict]], start: int = 1, upper: int = 1024,
                     rel_tol: float = 0.0, budget: float | None = None, guess: bool = True,
                     known: dict[int, dict] | None = None,
                     out_of_time: Callable[[], bool] | None = None) -> SearchResult:
    """The largest batch in [1, upper] for which the monotone `fits(b)` -> (fitted, details) holds, to within a gap
    of max(1, rel_tol × B).

    Each probe goes where `linear_guess` puts the limit, kept inside [lo + gap, hi − gap] so it narrows the bracket
    (two such probes once bracketed, then bisection); without a guess it doubles from `start`, then bisects. 4-6
    probes per H200 search where plain galloping took up to 11 (`benchmarks/search_replay.py`). `known`: earlier
    probes {batch: details with "status"} to resume from; `out_of_time()` stops it with `incomplete=True`."""
    start = check_positive_int(start, "start")
    upper = check_positive_int(upper, "upper")
    start = min(start, upper)
    res = SearchResult(0, None, False)

    def probe(b: int) -> bool:
        if b in res.results:
            return res.results[b]["status"] == "ok"
        ok, details = fits(b)
        details = res.results[b] = {**(details or {}), "status": "ok" if ok else "oom"}
        res.probes.append((b, details["status"]))
        return ok

    for b, details in sorted((known or {}).items()):
        if details.get("status") in ("ok", "oom") and 1 <= b <= upper:
            res.results[b] = dict(details)
            res.probes.append((b, details["status"]))
            res.resumed += 1
    # lo fits (0 = nothing yet), hi does not fit
    lo = max((b for b, r in res.results.items() if r["status"] == "ok"), default=0)
    hi = min((b for b, r in res.results.items() if r["status"] == "oom" and b > lo), default=None)
    if not res.results:
        if out_of_time is not None and out_of_time():
            res.incomplete = True
            return res
        if not probe(start):
            hi = start
        else:
            lo = start
    climb = 0  # probes in a row that fitted although the line had put the limit at or below them
    bracket_guesses = 2  # guided probes allowed once bracketed; then bisection (a wrong line cannot crawl)
    while True:
        gap = max(1, math.floor(rel_tol * max(lo, 1)))
        if hi is not None and hi - lo <= gap:
            break
        if hi is None and lo >= upper:
            res.max_batch, res.capped = lo, True
            return res
        g = linear_guess(res.results, budget) if guess else None
        if hi is None:
            if g is None:
                b = lo * 2
            elif g >= lo + gap:
                b, climb = g, 0
            else:  # first a gap (the line says the limit is right here), then the old gallop: B/32, doubling
                b = lo + (gap if climb == 0 else max(gap, lo // 32) * 2 ** (climb - 1))
                climb += 1
            b = min(upper, b)
        elif g is not None and lo < g < hi and bracket_guesses > 0:
            b = min(max(g, lo + gap), hi - gap) if hi - lo > 2 * gap else lo + gap
            bracket_guesses -= 1
        else:
            b = (lo + hi) // 2
        b = max(lo + 1, b) if hi is None else min(max(lo + 1, b), hi - 1)
        if out_of_time is not None and out_of_time():
            res.incomplete = True
            break
        if probe(b):
            lo = b
        else:
            hi = b
    res.max_batch, res.first_oom = lo, hi
    return res


# ---------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _gpu_total_bytes() -> int | None:
    """GPU 0's memory, asked of nvidia-smi or of a short-lived child (this process never initialises CUDA)."""
    import shutil
    import subprocess

    try:
        if shutil.which("nvidia-smi"):
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
            if out:
                return int(float(out[0]) * 2**20)
        code = ("import torch; print(torch.cuda.get_device_properties(0).total_memory "
                "if torch.cuda.is_available() else '')")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip()
        return int(out) if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def gpu_present() -> bool:
    """Whether this machine has a CUDA GPU (asked without initialising CUDA here)."""
    return _gpu_total_bytes() is not None


@dataclass
class Search:
    base: PointSpec  # batch_size is replaced by each probe's
    start: int
    upper: int
    rel_tol: float


def build_searches(models=("tiny-qwen3",), backends=("trl",), dtype="bf16", prompt_len=256, completion_len=512,
                   world_size=1, lora_r=16, budget_gib=None, budget_fraction=None, start=8, upper=1024,
                   rel_tol=0.0, steps=1, device="auto", budget_above_one_gib=None,
                   expandable_segments=False) -> list[Search]:
    """One search per model × backend, validated up front. The budget: `budget_gib`, or `budget_fraction` of the
    GPU, or `budget_above_one_gib` more than a one-sequence probe needs (the same in every environment), or the
    whole GPU (CPU needs one of the first and third). `expandable_segments`: every probe under
    `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, the setting the planner's max batch is validated for."""
    models = [check_model(m) for m in parse_str_list(models, "models")]
    backends = [resolve_backend(b) for b in parse_str_list(backends, "backends")]
    dtype = normalize_dtype(dtype)
    for name, v in (("prompt length", prompt_len), ("completion length", completion_len), ("world size", world_size),
                    ("start", start), ("upper", upper), ("steps", steps)):
        check_positive_int(v, name)
    if not 0 <= float(rel_tol) < 1:
        raise ValueError(f"rel_tol must be in [0, 1), got {rel_tol}: the search's gap as a fraction of the batch")
    if lora_r is None or int(lora_r) <= 0:
        raise ValueError("the FSDP max-batch search trains LoRA adapters: lora_r must be a positive integer")
    def no_gpu() -> bool:  # asked only where it matters (it may query nvidia-smi, once per process)
        return device == "cpu" or (device == "auto" and not gpu_present())

    common = dict(dtype=dtype, prompt_len=prompt_len, completion_len=completion_len, lora_r=int(lora_r), fsdp=True,
                  world_size=world_size, steps=steps, device=device)
    budget = None
    if budget_gib is not None:
        if float(budget_gib) <= 0:
            raise ValueError(f"budget must be positive, got {budget_gib}")
        budget = int(float(budget_gib) * GiB)
    elif budget_fraction is not None:
        if not 0 < float(budget_fraction) <= 1:
            raise ValueError(f"budget fraction must be in (0, 1], got {budget_fraction}")
        total = _gpu_total_bytes()
        if total is None:
            raise ValueError("budget_fraction needs a CUDA GPU; on CPU give budget_gib")
        budget = int(float(budget_fraction) * total)
    elif budget_above_one_gib is not None:
        if float(budget_above_one_gib) <= 0:
            raise ValueError(f"budget_above_one_gib must be positive, got {budget_above_one_gib}")
        r = run_point(PointSpec(model=models[0], loss_backend=backends[0], batch_size=1, **common))
        used = r["peak_bytes"] - (r.get("base_bytes", 0) if r.get("memory_kind") == "cpu_rss" else 0)
        budget = int(used + float(budget_above_one_gib) * GiB)
    elif no_gpu():
        raise ValueError("on CPU give a memory budget (budget_gib): there is no device limit to run into")
    if expandable_segments and no_gpu():
        raise ValueError("expandable_segments is a setting of the CUDA caching allocator: there is no GPU here")
    extra = {"cuda_alloc_conf": EXPANDABLE_SEGMENTS} if expandable_segments else {}
    return [Search(PointSpec(model=model, loss_backend=backend, batch_size=start, budget_bytes=budget,
                             extra=dict(extra), **common), start, upper, float(rel_tol))
            for model in models for backend in backends]


def run_searches(searches: list[Search], out_csv: str | Path | None = None, on_probe=None, on_search=None,
                 guess: bool = True, keep_going: bool = False, append: bool = False,
                 max_seconds: float | None = None, resume: bool = False,
                 seed_probes: str | Path | pd.DataFrame | None = None) -> pd.DataFrame:
    """Run each search; one row per search, and `<name>_probes.csv` (one row per probe) next to `out_csv`.

    A non-memory failure raises `ProbeError` (`keep_going`: recorded as `error`). `append` keeps `out_csv`'s rows of
    other (model, backend) pairs; after `max_seconds` the search under way is `incomplete`, the rest `skipped`.
    `resume` (implies `append`) starts each search from the probes CSV's probes of the same setting; `seed_probes`
    (implies `resume`) adds another CSV's probes of a search's exact setting (planner.check's pairs, say)."""
    resume = resume or seed_probes is not None
    append = append or resume
    env = run_record(searches[0].base.device if searches else "auto")
    rows, probe_rows = [], []
    previous = previous_probes = None
    if append and out_csv is not None:
        # the probes CSV is written after every probe, the main one after every search: a job killed during its
        # first search leaves only the former, and resume must still find it
        previous, previous_probes = (pd.read_csv(p) if p.is_file() else None
                                     for p in (Path(out_csv), _probes_path(out_csv)))
        done = {(s.base.model, s.base.loss_backend) for s in searches}
        if previous is not None:
            previous = previous[[(m, b) not in done for m, b in zip(previous["model"], previous["backend"])]]
        if previous_probes is not None:
            reusable = np.zeros(len(previous_probes), dtype=bool)
            if resume:  # a budget measured again (budget_above_one_gib) differs by RSS noise: adopt the recorded one
                searches = [_with_recorded_budget(previous_probes, s) for s in searches]
                for s in searches:
                    reusable |= _same_search(previous_probes, s)
            others = np.array([(m, b) not in done for m, b in
                               zip(previous_probes["model"], previous_probes["backend"])], dtype=bool)
            previous_probes = previous_probes[others | reusable]

    if seed_probes is not None:
        previous_probes = _with_seeds(previous_probes, seed_probes, searches)

    def merged(frame, old):
        return frame if old is None or old.empty else pd.concat([old, frame], ignore_index=True)

    total_budget = _gpu_total_bytes() if env["device"] == "cuda" or any(
        x.base.device == "cuda" for x in searches) else None
    t_start = time.perf_counter()
    for i, s in enumerate(searches):
        t0 = time.perf_counter()

        def fits(b, s=s):
            spec = s.base.replace(batch_size=b)
            r = run_point(spec)  # raises ProbeError on non-memory failures
            probe_rows.append({**make_row(FIGURE, spec, r, env), "_device_total": r.get("device_total_bytes"),
                               "cuda_alloc_conf": spec.extra.get("cuda_alloc_conf", "")})
            if on_probe is not None:
                on_probe(spec, r["status"])
            if out_csv is not None:
                frame = pd.DataFrame(probe_rows, columns=[*COLUMNS, "cuda_alloc_conf", "seeded_from"])
                write_csv(merged(frame, previous_probes), _probes_path(out_csv))
            return r["status"] == "ok", r

        budget = s.base.budget_bytes or total_budget
        if budget is None and probe_rows:  # no nvidia-smi: the GPU size the earlier probes reported
            budget = next((r.get("_device_total") for r in probe_rows if r.get("_device_total")), None)
        status, message = "ok", ""
        known = _known_probes(previous_probes, s) if resume and previous_probes is not None else {}

        def out_of_time():
            return max_seconds is not None and time.perf_counter() - t_start > max_seconds

        try:
            if out_of_time() and not known:  # with known probes the search may finish without a new one
                res, status, message = SearchResult(0, None, False), "skipped", f"not run: {max_seconds:.0f}s limit"
            else:
                res = search_max_batch(fits, start=s.start, upper=s.upper, rel_tol=s.rel_tol, budget=budget,
                                       guess=guess, known=known, out_of_time=out_of_time)
                if res.incomplete:
                    status = "incomplete"
                    message = (f"stopped by the {max_seconds:.0f}s limit: fits at {res.max_batch}, "
                               + (f"out of memory at {res.first_oom}" if res.first_oom else "no OOM yet")
                               + "; rerun with --resume to go on")
                if res.resumed:
                    message = (message + "; " if message else "") + f"resumed from {res.resumed} earlier probes"
        except ProbeError as e:
            if not keep_going:
                raise
            print(f"error in {s.base.model} {s.base.loss_backend} (continuing): {e}", file=sys.stderr, flush=True)
            res, status, message = SearchResult(0, None, False), "error", str(e)[-300:].replace("\n", " ")
        at_max = res.results.get(res.max_batch, {})
        gpu = next((r["gpu_name"] for r in reversed(probe_rows) if r.get("_device_total")), None)
        peak = at_max.get("peak_bytes")
        if peak is not None and at_max.get("memory_kind") == "cpu_rss":
            peak -= at_max.get("base_bytes", 0)
        rows.append({
            "figure": FIGURE, "model": s.base.model, "backend": s.base.loss_backend, "dtype": s.base.dtype,
            "lora_r": s.base.lora_r, "world_size": s.base.world_size, "prompt_len": s.base.prompt_len,
            "completion_len": s.base.completion_len, "steps": s.base.steps,
            "budget_gib": (budget or 0) / GiB, "max_batch": res.max_batch,
            "first_oom": res.first_oom, "capped": res.capped, "rel_tol": s.rel_tol,
            "peak_gib_at_max": None if peak is None else peak / GiB, "n_probes": len(res.probes),
            "probes": " ".join(f"{b}:{st}" for b, st in res.probes), "search_s": time.perf_counter() - t0,
            "status": status, "message": message, "cuda_alloc_conf": s.base.extra.get("cuda_alloc_conf", ""),
            **{k: env[k] for k in ENV_COLUMNS},
            **({"device": "cuda", "gpu_name": gpu} if gpu else {}),
        })
        df = pd.DataFrame(rows)
        if out_csv is not None:
            write_csv(merged(df, previous), out_csv)
        if on_search is not None:
            on_search(df, i, len(searches))
    return merged(pd.DataFrame(rows), previous)


def _same_search(probes: pd.DataFrame, s: Search, budget_rtol: float = 1e-3) -> np.ndarray:
    """Rows of a probes CSV that are probes of search `s` (same coordinates; a budget of the whole GPU is NaN;
    CSVs written before the `steps` column existed held one-step probes)."""
    b = s.base
    same = np.ones(len(probes), dtype=bool)
    for col, v in (("model", b.model), ("backend", b.loss_backend), ("dtype", b.dtype), ("prompt_len", b.prompt_len),
                   ("completion_len", b.completion_len), ("lora_r", b.lora_r), ("world_size", b.world_size)):
        same &= (probes[col] == v).to_numpy()
    steps = probes["steps"].fillna(1) if "steps" in probes else pd.Series(1, index=probes.index)
    same &= (steps == b.steps).to_numpy()
    same &= (text_column(probes, "cuda_alloc_conf") == b.extra.get("cuda_alloc_conf", "")).to_numpy()
    budget = probes["budget_gib"].to_numpy(dtype=float)
    want = np.nan if b.budget_bytes is None else b.budget_bytes / GiB
    same &= np.isclose(budget, want, rtol=budget_rtol, equal_nan=True)
    return same & probes["status"].isin(["ok", "oom"]).to_numpy()


def _with_recorded_budget(probes: pd.DataFrame, s: Search) -> Search:
    """`s` with the budget its earlier probes ran under, when that is within 2 % of its own (a budget measured
    again at run time, `budget_above_one_gib`, moves by RSS noise); else `s` unchanged."""
    if s.base.budget_bytes is None or _same_search(probes, s).any():
        return s
    near = probes[_same_search(probes, s, budget_rtol=0.02)]
    if near.empty:
        return s
    recorded = int(round(float(near["budget_gib"].iloc[-1]) * GiB))
    return Search(s.base.replace(budget_bytes=recorded), s.start, s.upper, s.rel_tol)


def _with_seeds(previous: pd.DataFrame | None, seeds: str | Path | pd.DataFrame,
                searches: list[Search]) -> pd.DataFrame | None:
    """`previous` (a probes CSV's rows, or None) plus the rows of `seeds` that probe one of `searches` under its
    exact setting and are not in `previous` already, in the probes CSV's columns; `seeded_from` names their file
    (so a validation does not count a measurement twice)."""
    seeds_path = None if isinstance(seeds, pd.DataFrame) else Path(seeds)
    seeds = seeds if seeds_path is None else pd.read_csv(seeds_path)
    match = np.zeros(len(seeds), dtype=bool)
    for s in searches:
        match |= _same_search(seeds, s)
    source = getattr(seeds_path, "name", "another run")
    new = seeds[match].reindex(columns=[*COLUMNS, "cuda_alloc_conf"]).assign(figure=FIGURE, seeded_from=source)
    if previous is None or previous.empty:
        return new
    key = ["model", "backend", "dtype", "prompt_len", "completion_len", "lora_r", "world_size", "batch_size",
           "cuda_alloc_conf"]
    both = pd.concat([previous, new], ignore_index=True)
    return both[~both[key].fillna("").duplicated()]  # a probe already in the CSV is kept, not seeded twice


def _known_probes(probes: pd.DataFrame, s: Search) -> dict[int, dict]:
    """The earlier probes of search `s` as search results (peaks back in bytes)."""
    out = {}
    for _, r in probes[_same_search(probes, s)].iterrows():
        d = {"status": r["status"], "memory_kind": r.get("memory_kind")}
        for col, key in (("peak_raw_gib", "peak_bytes"), ("reserved_gib", "reserved_bytes"), ("base_gib", "base_bytes"),
                         ("setup_gib", "setup_bytes")):
            if col in r and pd.notna(r[col]):
                d[key] = float(r[col]) * GiB
        out[int(r["batch_size"])] = d
    return out


def _probes_path(out_csv) -> Path:
    p = Path(out_csv)
    return p.with_name(p.stem + "_probes.csv")


def _save_png(df: pd.DataFrame, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from .plots import plot_max_batch, save_png  # matplotlib: only when a figure is drawn (a GPU box may lack it)

    return save_png(plot_max_batch(df), png)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_lab.memory.max_batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="CPU preset: 2 gloo processes, tiny models (default)")
    g.add_argument("--full", action="store_true", help="H200 preset: Qwen3 0.6B/1.7B/4B/8B, bf16 LoRA, world size 1")
    p.add_argument("--out", default="results/fsdp_max_batch")
    for key, kind in PRESET_FLAGS.items():  # unset: the preset's value
        p.add_argument("--" + key.replace("_", "-"), type=kind, help=PRESET_HELP.get(key))
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    alloc = p.add_mutually_exclusive_group()
    alloc.add_argument("--expandable-segments", action="store_true", default=None,
                       help="probe with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation at the "
                            "limit; the --full preset's default)")
    alloc.add_argument("--default-allocator", dest="expandable_segments", action="store_false",
                       help="probe with PyTorch's default caching allocator (the committed fsdp_max_batch.csv)")
    p.add_argument("--name")
    p.add_argument("--keep-going", action="store_true", help="record a failing search as an error and go on")
    p.add_argument("--append", action="store_true", help="keep the other (model, backend) rows of an existing CSV")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new probe after this long: the search under way is recorded as incomplete (its "
                        "bracket), the rest as skipped")
    p.add_argument("--overwrite", action="store_true", help="replace an existing CSV (refused otherwise)")
    p.add_argument("--resume", action="store_true",
                   help="go on from the probes already in <name>_probes.csv for the same setting (implies --append)")
    p.add_argument("--seed-probes", metavar="CSV",
                   help="also start from the probes of this CSV (e.g. planner.check's pairs) measured under the same "
                        "setting (implies --resume)")
    p.add_argument("--replot", metavar="CSV", help="only redraw the PNG of an existing CSV (next to it)")
    a = p.parse_args(argv)
    if a.replot:
        csv = Path(a.replot)
        if not csv.is_file():
            return cli_error(f"no CSV {csv}")
        print(f"wrote {_save_png(pd.read_csv(csv), csv.with_suffix('.png'))}")
        return 0
    flags = (*PRESET_FLAGS, "device", "expandable_segments")
    given = {k: getattr(a, k) for k in flags if getattr(a, k) is not None}
    preset = dict(PRESETS["full" if a.full else "quick"])
    if given.keys() & {"budget_gib", "budget_fraction"}:  # a budget given replaces the preset's
        preset.update(budget_gib=None, budget_fraction=None, budget_above_one_gib=None)
    preset.update(given)
    if a.expandable_segments is None and preset["device"] == "cpu":
        preset["expandable_segments"] = False  # the preset's allocator setting is for CUDA; on CPU it has no meaning
    try:
        require_liger_if_named(parse_str_list(preset["backends"], "backends"))
        searches = build_searches(**preset)
        name = a.name or (f"{FIGURE}_quick" if not a.full else
                          f"{FIGURE}_expandable" if preset["expandable_segments"] else FIGURE)
        csv = target_csv(a.out, name, keep=a.append or a.resume or bool(a.seed_probes), overwrite=a.overwrite)
        if a.seed_probes and not Path(a.seed_probes).is_file():
            raise ValueError(f"no probes CSV {a.seed_probes} to seed the searches from")
    except ValueError as e:
        return cli_error(e)
    out = csv.parent
    print(f"{len(searches)} searches → {csv}", flush=True)

    def on_probe(spec, status):
        print(f"  {spec.model} {spec.loss_backend} B={spec.batch_size}: {status}", flush=True)

    def on_search(df, i, n):
        r = df.iloc[-1]
        print(f"[{i + 1}/{n}] {r['model']} {r['backend']}: max batch {r['max_batch']} "
              f"({r['n_probes']} probes, {r['search_s']:.0f}s)", flush=True)

    try:
        df = run_searches(searches, out_csv=csv, on_probe=on_probe, on_search=on_search, keep_going=a.keep_going,
                          append=a.append, max_seconds=None if a.max_minutes is None else a.max_minutes * 60,
                          resume=a.resume, seed_probes=a.seed_probes or None)
    except ProbeError as e:
        return cli_error(e, 1)
    try:
        _save_png(df, out / f"{name}.png")
    except ImportError as e:  # a GPU box without matplotlib: the CSV is the result, plot it elsewhere
        print(f"note: no PNG ({e}); the CSV is written", file=sys.stderr)
    with pd.option_context("display.width", 160):
        print(ratio_table(df).to_string())
    print(f"wrote {csv}, {_probes_path(csv)} and {out / (name + '.png')}")
    return 1 if (df.get("status") == "error").any() else 0


if __name__ == "__main__":
    sys.exit(main())
