"""What the adapters a CPU replica holds cost it: time per completion, per adapter load and per unload, against the
number of adapters resident. A shared pool's replica holds every run's live versions (K runs x (max_staleness + 1)),
a run's own pool only its own, so a cost that grows with residency is a cost of sharing on this engine.

    python benchmarks/replica_adapters_bench.py --resident 1 6 12 24 --repeats 3

Each completion names one of `--switching` adapters in turn (a shared pool interleaves runs' requests), so the engine
switches its active adapter at every request; times are the best of `--repeats` rounds (the machine's other load
only adds). Printed, and written to `--out` as CSV with the machine, versions and date.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
try:  # an importable grpo_lab first (an older checkout's, to compare engines); else this checkout
    import grpo_lab  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

from grpo_lab.lab.records import run_record  # noqa: E402
from grpo_lab.models import build_model  # noqa: E402
from grpo_lab.serving.replicas.config import CPUReplicaConfig  # noqa: E402
from grpo_lab.serving.replicas.generation import Engine, SamplingParams  # noqa: E402


def save_adapters(count: int, folder: Path) -> list[str]:
    """`count` rank-1 all-linear adapters of the embedded model, as the loop publishes them."""
    from peft import LoraConfig, get_peft_model

    paths = []
    for i in range(count):
        base = build_model("tiny-qwen3")  # seeds torch itself: each adapter's own seed comes after
        torch.manual_seed(i)
        model = get_peft_model(base, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear",
                                                init_lora_weights=False))
        model.save_pretrained(folder / f"a{i}")
        paths.append(str(folder / f"a{i}"))
    return paths


def best_ms(work, repeats: int, times: int = 1) -> float:
    """The best of `repeats` rounds of `times` calls of `work`, in ms per call."""
    rounds = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(times):
            work()
        rounds.append((time.perf_counter() - started) / times)
    return round(min(rounds) * 1e3, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resident", type=int, nargs="+", default=[1, 6, 12, 24])
    parser.add_argument("--switching", type=int, default=4, help="adapters the completions take turns naming")
    parser.add_argument("--completions", type=int, default=8, help="completions per round")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="current", help="names the engine measured in the CSV (run an older "
                        "checkout's engine with PYTHONPATH=<its root>: an importable grpo_lab is used first)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "sweep" / "replica_adapters.csv")
    args = parser.parse_args(argv)
    for flag, values in (("--resident", args.resident), ("--switching", [args.switching]),
                         ("--completions", [args.completions]), ("--max-tokens", [args.max_tokens]),
                         ("--repeats", [args.repeats])):
        if min(values) < 1:
            parser.error(f"{flag} must be >= 1, got {min(values)}")
    torch.set_num_threads(1)  # a replica of the pool has one core
    paths = save_adapters(max(args.resident) + 1, Path(tempfile.mkdtemp(prefix="replica-adapters-")))
    engine = Engine(CPUReplicaConfig(max_loras=max(args.resident) + 1, prefix_cache_blocks=0, torch_threads=1))
    prompt, rows, held = list(range(100, 140)), [], 0
    for resident in sorted(args.resident):
        while held < resident:
            engine.load_adapter(f"a{held}", paths[held])
            held += 1
        turn = itertools.count()

        def complete():
            i = next(turn)
            engine.generate(f"a{i % min(args.switching, held)}", prompt,
                            SamplingParams(max_tokens=args.max_tokens, seed=i, ignore_eos=True))

        def load_and_unload():
            engine.load_adapter("extra", paths[-1])
            engine.unload_adapter("extra")

        rows.append({"resident": resident, "completion_ms": best_ms(complete, args.repeats, args.completions),
                     "load_unload_ms": best_ms(load_and_unload, args.repeats), "max_tokens": args.max_tokens,
                     "switching": min(args.switching, held), "engine": args.label})
        print(f"{resident:3d} adapters resident: {rows[-1]['completion_ms']} ms a completion "
              f"({args.max_tokens} tokens), {rows[-1]['load_unload_ms']} ms a load + unload", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).assign(**run_record()).to_csv(args.out, index=False)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
