"""Peak memory vs batch size: backend × dtype × batch size (× model, lengths), each point in fresh processes.

    python -m grpo_lab.memory.sweep --quick --out results/memory_vs_batch      # CPU, tiny model, ~1 min
    python -m grpo_lab.memory.sweep --full  --out results/memory_vs_batch      # one H200, ~10 min of probes

Points are `step` (real TRL GRPO steps, `grpo_step`) or `loss` (the head and loss alone, `loss_probe`). Once a backend
runs out of memory, its larger batch sizes are recorded as OOM without being run.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from ..lab.records import run_record
from ..loss.backends import DISPLAY_ORDER, LOGPROB_BACKENDS, in_display_order, resolve_backend
from .probe import ProbeError, run_point
from .results import cli_error, make_row, rows_to_frame, savings_table, target_csv, write_csv
from .spec import (
    PointSpec,
    normalize_dtype,
    parse_int_list,
    parse_str_list,
    require_liger_if_named,
)

FIGURE = "memory_vs_batch"

PRESETS = {
    # CPU quick mode: a small Qwen3-shaped model whose vocabulary is large enough for the logits to show
    "quick": dict(model="small-qwen3", backends=in_display_order(LOGPROB_BACKENDS), dtypes=["fp32", "bf16"],
                  batch_sizes=[2, 4, 8], prompt_len=32, completion_len=64, modes=["step", "loss"],
                  loss_batch_sizes=[2, 4, 8]),
    # One H200: Qwen3-0.6B, 256 prompt + 512 completion tokens; past naive's OOM for the fused backends
    "full": dict(model="Qwen3-0.6B", backends=list(DISPLAY_ORDER), dtypes=["bf16", "fp32"],
                 batch_sizes=[4, 8, 16, 32, 48, 64, 96], prompt_len=256, completion_len=512,
                 modes=["loss", "step"], loss_batch_sizes=[4, 16, 64]),  # the cheap loss-alone points first
}
# the command line's flags over a preset's fields (type of each), and the ones that need a word of help
PRESET_FLAGS = {"model": str, "backends": str, "dtypes": str, "batch_sizes": str, "loss_batch_sizes": str,
                "prompt_len": int, "completion_len": int, "modes": str}
PRESET_HELP = {"backends": f"comma-separated loss backends: {','.join(DISPLAY_ORDER)}", "modes": "step,loss",
               "dtypes": "comma-separated: fp32,bf16", "batch_sizes": "comma-separated positive ints"}


def build_specs(model="tiny-qwen3", backends=("trl",), dtypes=("fp32",), batch_sizes=(2, 4), prompt_len=16,
                completion_len=16, modes=("step",), loss_batch_sizes=None, device="auto",
                pretrained=False) -> list[PointSpec]:
    """The grid, validated up front (unknown model/backend/dtype or non-positive sizes → ValueError; the model is
    checked by each `PointSpec`). `pretrained=True` loads real weights with `from_pretrained(model)` (a hub id
    online, or a local folder)."""
    backends = [resolve_backend(b) for b in parse_str_list(backends, "backends")]
    dtypes = [normalize_dtype(d) for d in parse_str_list(dtypes, "dtypes")]
    batch_sizes = parse_int_list(batch_sizes, "batch sizes")
    loss_batch_sizes = parse_int_list(loss_batch_sizes, "loss batch sizes") if loss_batch_sizes else batch_sizes
    modes = parse_str_list(modes, "modes")
    return [PointSpec(model=model, loss_backend=backend, dtype=dtype, batch_size=b, prompt_len=prompt_len,
                      completion_len=completion_len, mode=mode, device=device, pretrained=pretrained)
            for mode, dtype, backend in itertools.product(modes, dtypes, backends)
            for b in (batch_sizes if mode == "step" else loss_batch_sizes)]


def _series_key(s: PointSpec):
    return (s.model, s.loss_backend, s.dtype, s.mode, s.prompt_len, s.completion_len, s.lora_r)


def run_sweep(specs: list[PointSpec], out_csv: str | Path | None = None,
              on_point: Callable[[dict, int, int], None] | None = None, max_seconds: float | None = None,
              keep_going: bool = False, append: bool = False, resume: bool = False) -> pd.DataFrame:
    """Measure every spec in order, rewriting the CSV after each point (an interrupted sweep keeps what it measured).

    A non-memory failure raises `ProbeError` (`keep_going`: recorded as `error`, the rest of its series skipped).
    `append` keeps `out_csv`'s rows at other coordinates; `resume` (implies `append`) skips the points it holds as ok
    or oom, whose OOMs stop their series: a sweep cut by `max_seconds` then measures only what is missing."""
    append = append or resume
    env = run_record(specs[0].device if specs else "auto")
    rows: list[dict] = []
    oom_at: dict = {}
    failed: set = set()
    previous = None
    if append and out_csv is not None and Path(out_csv).is_file():
        previous = pd.read_csv(out_csv)
        if resume:
            specs, oom_at = _unmeasured(specs, previous)
        new = {(s.model, s.mode, s.dtype, s.loss_backend, s.batch_size) for s in specs}
        keys = zip(previous["model"], previous["mode"], previous["dtype"], previous["backend"], previous["batch_size"])
        previous = previous[[k not in new for k in keys]]
    t0 = time.perf_counter()
    for i, spec in enumerate(specs):
        key = _series_key(spec)
        if key in oom_at and spec.batch_size > oom_at[key]:
            result = {"status": "oom", "message": f"not run: batch {oom_at[key]} already out of memory"}
        elif key in failed:
            result = {"status": "error", "message": "not run: an earlier point of this series failed"}
        elif max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            result = {"status": "skipped", "message": f"not run: sweep time limit {max_seconds:.0f}s reached"}
        else:
            try:
                result = run_point(spec)
            except ProbeError as e:
                if not keep_going:
                    raise
                print(f"error (continuing): {e}", file=sys.stderr, flush=True)
                result = {"status": "error", "message": str(e)[-300:]}
                failed.add(key)
            if result["status"] == "oom":
                oom_at[key] = min(oom_at.get(key, spec.batch_size), spec.batch_size)
        row = make_row(FIGURE, spec, result, env)
        rows.append(row)
        if out_csv is not None:
            frame = rows_to_frame(rows)
            write_csv(frame if previous is None else pd.concat([previous, frame], ignore_index=True), out_csv)
        if on_point is not None:
            on_point(row, i, len(specs))
    frame = rows_to_frame(rows)
    return frame if previous is None else pd.concat([previous, frame], ignore_index=True)


def _unmeasured(specs: list[PointSpec], previous: pd.DataFrame) -> tuple[list[PointSpec], dict]:
    """The specs `previous` does not hold as ok/oom at the same lengths, and the OOM batch per series it holds."""
    done = previous[previous["status"].isin(["ok", "oom"])]
    status: dict[tuple, set] = {}  # point coordinates -> the statuses recorded there
    for r in done.itertuples():
        key = (r.model, r.mode, r.dtype, r.backend, int(r.batch_size), int(r.prompt_len), int(r.completion_len))
        status.setdefault(key, set()).add(r.status)
    left, oom_at = [], {}
    for s in specs:
        prompt_len = s.prompt_len if s.mode == "step" else 0  # how make_row records a loss-alone point
        recorded = status.get((s.model, s.mode, s.dtype, s.loss_backend, s.batch_size, prompt_len, s.completion_len))
        if recorded is None:
            left.append(s)
        elif "oom" in recorded:
            key = _series_key(s)
            oom_at[key] = min(oom_at.get(key, s.batch_size), s.batch_size)
    return left, oom_at


def _print_point(row: dict, i: int, n: int) -> None:
    peak = "OOM" if row["status"] == "oom" else (row["status"] if row["peak_gib"] is None else f"{row['peak_gib']:.3f} GiB")
    print(f"[{i + 1}/{n}] {row['mode']:4s} {row['dtype']} {row['backend']:8s} B={row['batch_size']:<4d} {peak}"
          f"  ({row['wall_s'] or 0:.1f}s)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_lab.memory.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="CPU-sized preset (default)")
    g.add_argument("--full", action="store_true", help="the H200 preset: Qwen3-0.6B, 256+512 tokens, 4 backends")
    p.add_argument("--out", default="results/memory_vs_batch", help="output folder (CSV + PNG)")
    for key, kind in PRESET_FLAGS.items():  # unset: the preset's value
        p.add_argument("--" + key.replace("_", "-"), type=kind, help=PRESET_HELP.get(key))
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--pretrained", action="store_true", help="load real weights: --model is a hub id or a folder")
    p.add_argument("--max-minutes", type=float, default=None, help="stop starting new points after this long")
    p.add_argument("--name", default=None, help="CSV/PNG base name (default: memory_vs_batch[_quick])")
    p.add_argument("--keep-going", action="store_true", help="record a failing point as an error and go on")
    p.add_argument("--append", action="store_true", help="keep the other rows of an existing CSV (split runs)")
    p.add_argument("--resume", action="store_true",
                   help="measure only the points the CSV does not hold yet as ok/oom (implies --append)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing CSV (refused otherwise)")
    p.add_argument("--replot", metavar="CSV", help="only redraw the PNGs of an existing CSV (next to it)")
    a = p.parse_args(argv)
    if a.replot:
        csv = Path(a.replot)
        if not csv.is_file():
            return cli_error(f"no CSV {csv}")
        paths = save_figures(pd.read_csv(csv), csv.parent, csv.stem)
        print("wrote " + ", ".join(map(str, paths)))
        return 0
    preset = {**PRESETS["full" if a.full else "quick"],
              **{k: getattr(a, k) for k in PRESET_FLAGS if getattr(a, k) is not None}}
    if a.batch_sizes is not None and a.loss_batch_sizes is None:  # one list given: it is meant for both kinds
        preset["loss_batch_sizes"] = a.batch_sizes
    try:
        specs = build_specs(device=a.device, pretrained=a.pretrained, **preset)
        require_liger_if_named({s.loss_backend for s in specs})
        name = a.name or (FIGURE if a.full else f"{FIGURE}_quick")
        csv = target_csv(a.out, name, keep=a.append or a.resume, overwrite=a.overwrite)
    except ValueError as e:
        return cli_error(e)
    out = csv.parent
    print(f"{len(specs)} points → {csv}", flush=True)
    try:
        df = run_sweep(specs, out_csv=csv, on_point=_print_point, keep_going=a.keep_going, append=a.append,
                       max_seconds=None if a.max_minutes is None else a.max_minutes * 60, resume=a.resume)
    except ProbeError as e:
        return cli_error(e, 1)
    try:
        save_figures(df, out, name)
    except ImportError as e:  # a GPU box without matplotlib: the CSV is the result, plot it elsewhere
        print(f"note: no PNG ({e}); the CSV is written", file=sys.stderr)
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(savings_table(df).to_string())
    print(f"wrote {csv} and {out / (name + '.png')}")
    return 1 if (df["status"] == "error").any() else 0


def save_figures(df: pd.DataFrame, out: Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from .plots import plot_memory_vs_batch, save_png  # matplotlib: only when a figure is drawn (a GPU box may lack it)

    return [save_png(plot_memory_vs_batch(df, mode=mode), Path(out) / f"{name}{suffix}.png")
            for mode, suffix in (("step", ""), ("loss", "_loss_only")) if (df["mode"] == mode).any()]


if __name__ == "__main__":
    sys.exit(main())
