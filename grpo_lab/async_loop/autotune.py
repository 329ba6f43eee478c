"""Autotune: the doctor turns the knob itself, between steps, without restarting anything.

`Autotuner` reads each logged step (TRL's own metric names) and moves the rollout worker's two live knobs
(`live_knobs.LiveKnobs`): the requests in flight and the rollout queue's bound. Both are counted against one pipeline
budget of `max(max_staleness, 1)` steps of samples (a sample admitted behind N others is trained about
N / `samples_per_step` steps later). The regimes, the settling time after a change, the probes and the damping that
keeps a knob from oscillating are described in docs/async_loop.md ("Autotune"). Decisions are plain data
(`Decision`) with their evidence, so a recorded trace can be replayed through the controller (tests/async_loop).
Knobs that need a restart are only recommended (`Autotuner.recommendations`); `AutotuneCallback` wires the
controller into the trainer and adds `autotune/*` metrics to the logs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from transformers import TrainerCallback

from ..lab.settings import Range, check_fields, setting


@dataclass
class AutotuneConfig:
    """Thresholds and bounds of [`Autotuner`]; a bound of 0 is derived from the run (`resolve_bounds`).

    Bounds: `min_inflight` (0: `num_generations`), `max_inflight` (0: the budget less the smallest queue bound),
    `min_queue` (0: one step of samples), `max_queue` (0: the run's `queue_maxsize`), `budget_steps` (0:
    `max(max_staleness, 1)`, TRL's default in flight). Timing: `warmup_steps` logged steps before any decision,
    `window` settled steps per reading, `patience` readings in a row per change, at least `cooldown_steps` after
    one (an in-flight change waits until the samples admitted before it are out, at most `max_staleness + 1` steps).
    Regimes, as shares of the step or of the samples: rollout-bound above `rollout_wait_high`, starving from
    `starving` (raised at once by `1 / (1 - wait share)`, 2 to `slow_start_max_factor`), staleness-bound above
    `waste_high` wasted or `staleness_high` of `max_staleness` (cut at once from `wasting`), train-bound above
    `backpressure_high`; no raise once staleness reaches `raise_below_staleness`. Steps: a raise multiplies by
    `up_factor`, a cut by `down_factor`, each reversal halving the part of the step above 1. Probes: judged on
    `probe_steps` steps, reverted when samples got wasted or steps got more than `max_loss` slower beyond twice the
    standard error; a reverted raise is a ceiling for `reprobe_steps` steps (0: for ever).
    """

    min_inflight: int = setting(0, check=Range(0))
    max_inflight: int = setting(0, check=Range(0))
    min_queue: int = setting(0, check=Range(0))
    max_queue: int = setting(0, check=Range(0))
    budget_steps: int = setting(0, check=Range(0))
    warmup_steps: int = setting(2, check=Range(0))
    window: int = setting(3, check=Range(1))
    patience: int = setting(2, check=Range(1))
    cooldown_steps: int = setting(1, check=Range(0))
    rollout_wait_high: float = 0.2
    starving: float = 0.5
    slow_start_max_factor: float = setting(4.0, check=Range(2))
    waste_high: float = 0.02
    wasting: float = 0.2
    staleness_high: float = 0.75
    raise_below_staleness: float = 0.5
    backpressure_high: float = 0.1
    up_factor: float = setting(2.0, check=Range(1, open=True))
    down_factor: float = setting(0.5, check=Range(0, open=True, high=1))
    probe_steps: int = setting(3, check=Range(1))
    max_loss: float = 0.1
    reprobe_steps: int = 12

    def __post_init__(self):
        check_fields(self)
        if self.down_factor == 1:
            raise ValueError("down_factor must be < 1 (a cut that keeps the knob is no cut)")


@dataclass
class Bounds:
    """The knobs' resolved bounds for one run, and the pipeline budget (samples in flight plus queued)."""

    min_inflight: int
    max_inflight: int
    min_queue: int
    max_queue: int
    budget: int


def resolve_bounds(config: AutotuneConfig, start_inflight: int, start_queue: int, num_generations: int,
                   samples_per_step: int, max_staleness: int) -> Bounds:
    """Bounds of a run: `config`'s, or derived from its settings (see `AutotuneConfig`). A start below the floors is
    kept as the floor (a loop started at 1 in flight climbs from there); a start above the budget is not a bound:
    the controller clamps it before the first request."""
    from .loop_settings import inflight_tasks

    trl_default = inflight_tasks(-1, max_staleness, samples_per_step)
    budget = config.budget_steps * samples_per_step if config.budget_steps else trl_default
    min_queue = max(min(config.min_queue or samples_per_step, start_queue), 1)
    max_queue = max(config.max_queue or start_queue, min_queue)
    min_inflight = max(min(config.min_inflight or num_generations, start_inflight), 1)
    max_inflight = max(config.max_inflight or budget - min_queue, min_inflight)
    return Bounds(min_inflight, max_inflight, min_queue, max_queue, max(budget, min_inflight + min_queue))


@dataclass
class Reading:
    """The signals of one or more logged steps, as the controller reads them."""

    steps: int
    step_s: float
    wait_share: float  # perf/rollout_wait_s over perf/step_s
    waste_share: float  # samples dropped as stale (abandoned groups included) over samples produced
    staleness_ratio: float  # sample/staleness_mean over max_staleness
    backpressure_share: float  # rollout/backpressure_s over perf/step_s

    @property
    def steps_per_s(self) -> float:
        return 1.0 / self.step_s if self.step_s > 0 else 0.0

    def evidence(self) -> dict:
        return {"rollout_wait_share": round(self.wait_share, 4), "waste_share": round(self.waste_share, 4),
                "staleness_ratio": round(self.staleness_ratio, 4),
                "backpressure_share": round(self.backpressure_share, 4), "steps_per_s": round(self.steps_per_s, 4),
                "steps": self.steps}


def read_steps(rows: list[dict], max_staleness: int, num_generations: int) -> Reading | None:
    """One `Reading` of logged rows (TRL's metric names); None when none of them is a timed training step."""
    rows = [r for r in rows if r.get("perf/step_s")]
    if not rows:
        return None
    step_s = sum(r["perf/step_s"] for r in rows)
    wait = sum(r.get("perf/rollout_wait_s") or 0.0 for r in rows)
    backpressure = sum(r.get("rollout/backpressure_s") or 0.0 for r in rows)
    consumed = sum(r.get("batch/samples_per_step") or 0.0 for r in rows)
    wasted = sum((r.get("sample/dropped_stale_total") or 0.0)
                 + (r.get("rollout/abandoned_groups_total") or 0.0) * num_generations for r in rows)
    staleness = [r["sample/staleness_mean"] for r in rows if r.get("sample/staleness_mean") is not None]
    mean_staleness = sum(staleness) / len(staleness) if staleness else 0.0
    return Reading(len(rows), step_s / len(rows), min(wait / step_s, 1.0), wasted / max(consumed + wasted, 1.0),
                   mean_staleness / max(max_staleness, 1), min(backpressure / step_s, 1.0))


@dataclass
class Decision:
    """One change of a knob, with why."""

    step: int
    knob: str  # "inflight" or "queue"
    old: int
    new: int
    regime: str  # "budget", "staleness", "starving", "rollout", "train", "balanced" or "probe"
    reason: str
    evidence: dict = field(default_factory=dict)

    def line(self) -> str:
        name = "in flight" if self.knob == "inflight" else "queue bound"
        head = f"autotune: step {self.step}: {name} {self.old} -> {self.new} ({self.regime}"
        e = self.evidence
        if not e.get("steps"):  # decided from the run's settings, before any step
            return f"{head}: {self.reason})"
        bound = "" if self.regime in ("balanced", "probe") else "-bound"
        return (f"{head}{bound}: {self.reason}; rollout wait {100 * e.get('rollout_wait_share', 0):.0f}% of the step, "
                f"wasted {100 * e.get('waste_share', 0):.1f}%, staleness {e.get('staleness_ratio', 0):.2f} of max, "
                f"backpressure {100 * e.get('backpressure_share', 0):.0f}%, {e.get('steps_per_s', 0):.3f} steps/s)")


def slowdown(before: list[float], after: list[float]) -> float:
    """How much longer the steps `after` took than those `before`, as a fraction of the latter; 0 unless the
    difference of the means exceeds twice its standard error (the spread of the steps explains it)."""
    if not before or not after:
        return 0.0
    mean_b, mean_a = statistics.fmean(before), statistics.fmean(after)
    error = math.sqrt(sum(statistics.variance(xs) / len(xs) for xs in (before, after) if len(xs) > 1))
    if mean_b <= 0 or mean_a - mean_b <= 2 * error:
        return 0.0
    return (mean_a - mean_b) / mean_b


def classify(reading: Reading, c: AutotuneConfig) -> str:
    """The regime a reading shows (the doctor's, with the controller's thresholds)."""
    if reading.waste_share > c.waste_high or reading.staleness_ratio > c.staleness_high:
        return "staleness"
    if reading.wait_share > c.rollout_wait_high:
        return "starving" if reading.wait_share >= c.starving else "rollout"
    if reading.backpressure_share > c.backpressure_high:
        return "train"
    return "balanced"


class Autotuner:
    """The controller: `observe(step, row)` after each logged step returns the decisions taken at it (usually none);
    `inflight` and `queue_bound` are the knobs' values now, starting from the run's settings; `decisions` starts with
    the step-0 clamps of a start beyond the pipeline budget."""

    def __init__(self, config: AutotuneConfig, inflight: int, queue_bound: int, num_generations: int,
                 samples_per_step: int, max_staleness: int):
        self.config = config
        self.bounds = resolve_bounds(config, inflight, queue_bound, num_generations, samples_per_step, max_staleness)
        self.num_generations, self.samples_per_step, self.max_staleness = (num_generations, samples_per_step,
                                                                          max_staleness)
        self.inflight, self.queue_cap = inflight, queue_bound  # the queue bound applied is `queue_bound` below
        self.ceiling = self.bounds.max_inflight  # no raise goes above (lowered by waste and by failed probes)
        self.decisions: list[Decision] = []
        self.recommendations: list[str] = []
        self._rows: list[tuple[int, dict]] = []  # (step, logged row) since the last change
        self._seen = 0
        self._settled_after = -1  # readings use the steps after this one
        self._streak: tuple[str, int] = ("", 0)
        self._probe: tuple[int, list[float]] | None = None  # (in flight before the raise, step times before it)
        self._settled: list[dict] = []  # the settled rows of the reading being acted on
        # per knob: its last direction and its step scale, halved at every reversal of that knob (a queue cut
        # says nothing about how far the requests in flight should still climb)
        self._last_direction = {"inflight": 0, "queue": 0}
        self._step_scale = {"inflight": 1.0, "queue": 1.0}
        self._ceiling_set_at = 0
        self._stale_ceiling = self.bounds.max_inflight
        self._clamp_to_budget()

    @property
    def queue_bound(self) -> int:
        """The queue bound in force: its own value, within what the pipeline budget leaves beside the requests in
        flight, never under its floor."""
        room = self.bounds.budget - self.inflight
        return int(max(self.bounds.min_queue, min(self.queue_cap, room, self.bounds.max_queue)))

    def _clamp_to_budget(self) -> None:
        """The step-0 decisions: a start beyond the pipeline budget is brought inside it before any request."""
        queue_before = self.queue_cap
        if self.inflight > self.bounds.max_inflight:
            self.decisions.append(Decision(
                0, "inflight", self.inflight, self.bounds.max_inflight, "budget",
                f"the pipeline budget is {self.bounds.budget} samples (max_staleness steps of samples, in flight and "
                "queued together): beyond it, requests make samples that are dropped as stale"))
            self.inflight = self.bounds.max_inflight
        if self.queue_bound < queue_before:
            self.decisions.append(Decision(0, "queue", queue_before, self.queue_bound, "budget",
                                           f"with {self.inflight} in flight, the pipeline budget of "
                                           f"{self.bounds.budget} samples leaves this much for the queue"))

    # -- reading --------------------------------------------------------------------------------------------------
    def observe(self, step: int, row: dict) -> list[Decision]:
        if not row.get("perf/step_s"):
            return []
        self._seen += 1
        keep = max(self.config.window, self.config.probe_steps) + 2
        self._rows = self._rows[-keep:] + [(step, row)]
        if self._seen <= self.config.warmup_steps or step <= self._settled_after:
            return []
        settled = [r for s, r in self._rows if s > self._settled_after]
        if self._probe is not None:
            if len(settled) >= self.config.probe_steps:
                return self._judge_probe(step, settled[-self.config.probe_steps:])
            return []
        reading = read_steps(settled[-self.config.window:], self.max_staleness, self.num_generations)
        if reading is None:
            return []
        regime = classify(reading, self.config)
        self._streak = (regime, self._streak[1] + 1 if self._streak[0] == regime else 1)
        urgent = regime == "starving" or (regime == "staleness" and reading.waste_share >= self.config.wasting)
        if not urgent and (self._streak[1] < self.config.patience or reading.steps < self.config.window):
            return []  # a calm regime acts on full readings only, and only when it holds
        self._settled = settled[-self.config.probe_steps:]
        return getattr(self, f"_on_{regime}")(step, reading)

    # -- regimes --------------------------------------------------------------------------------------------------
    def _on_staleness(self, step: int, r: Reading) -> list[Decision]:
        full_queue = r.backpressure_share > self.config.backpressure_high
        fed = r.wait_share <= self.config.rollout_wait_high  # rollouts are ready before the trainer asks
        if (full_queue or fed) and self.queue_bound > self.bounds.min_queue:
            # the samples age in the queue, not in flight: a cut of the requests would starve the trainer and,
            # as a ceiling, keep it starved
            new = max(self.bounds.min_queue, math.floor(self.queue_bound * self._down("queue")))
            why = ("samples age in a full queue" if full_queue
                   else "the trainer does not wait for rollouts: samples age in the queue")
            return self._change(step, "queue", new, "staleness", why, r, -1)
        if self.inflight > self.bounds.min_inflight:
            self._stale_ceiling = min(self._stale_ceiling, self.inflight - 1)  # this many aged samples: never again
            self.ceiling = min(self.ceiling, self._stale_ceiling)
            new = max(self.bounds.min_inflight, math.floor(self.inflight * self._down("inflight")))
            return self._change(step, "inflight", new, "staleness", "samples go stale before they are trained on",
                                r, -1)
        self._recommend("staleness at the lowest in-flight bound: more replicas, or a larger max_staleness "
                        "(one more adapter slot per step)")
        return []

    def _raise_allowed(self, step: int, r: Reading) -> bool:
        if r.staleness_ratio >= self.config.raise_below_staleness:
            # the samples already arrive old: more in flight would only make them older (and then wasted)
            self._recommend("rollout-bound with samples already near max_staleness: more replicas (a restart)")
            return False
        if self.inflight >= self.ceiling and step - self._ceiling_set_at >= self.config.reprobe_steps > 0:
            self.ceiling = self._stale_ceiling  # still rollout-bound long after a failed raise: try again
        if self.inflight >= self.ceiling:
            self._recommend("rollout-bound with in flight at its ceiling: more replicas (a restart)")
            return False
        return True

    def _on_starving(self, step: int, r: Reading) -> list[Decision]:
        feeding = 1 / max(1 - r.wait_share, 1e-6)  # the rollout rate the trainer takes, over the rate it gets
        return self._raise(step, r, min(max(feeding, 2.0), self.config.slow_start_max_factor), "starving",
                           "the trainer waits for rollouts most of the step", probe=False)

    def _on_rollout(self, step: int, r: Reading) -> list[Decision]:
        return self._raise(step, r, self.config.up_factor, "rollout", "the trainer waits for rollouts")

    def _raise(self, step: int, r: Reading, up: float, regime: str, reason: str, probe: bool = True) -> list[Decision]:
        """In flight times `up` (damped after a reversal; one more at least, the ceiling at most) if `_raise_allowed`;
        a `probe` is judged on the next `probe_steps` steps against the settled steps before it."""
        if not self._raise_allowed(step, r):
            return []
        factor = 1 + (up - 1) * self._scale("inflight", +1)
        new = min(self.ceiling, max(self.inflight + 1, math.ceil(self.inflight * factor)))
        before = self.inflight
        decisions = self._change(step, "inflight", new, regime, reason, r, +1)
        if decisions and probe:
            self._probe = (before, [row["perf/step_s"] for row in self._settled])
        return decisions

    def _on_train(self, step: int, r: Reading) -> list[Decision]:
        self._recommend("train-bound: pack rows (token_budget), gradient checkpointing off if memory allows "
                        "(both need a restart)")
        if r.staleness_ratio > 0.5 and self.queue_bound > self.bounds.min_queue:
            new = max(self.bounds.min_queue, math.floor(self.queue_bound * self.config.down_factor))
            return self._change(step, "queue", new, "train", "the trainer is the bottleneck and samples age in the "
                                "queue", r, -1)
        return []

    def _on_balanced(self, step: int, r: Reading) -> list[Decision]:
        if (self.inflight >= min(self.samples_per_step, self.ceiling)
                or r.staleness_ratio >= self.config.raise_below_staleness):
            return []
        # fewer requests than a step trains on: the trainer is fed from what queued up, and each step needs more
        # than one round of generation; on shared cores the replicas' long trickle also slows the trainer
        return self._raise(step, r, self.config.up_factor, "balanced", "fewer requests in flight than a step trains on")

    def _judge_probe(self, step: int, rows: list[dict]) -> list[Decision]:
        before, times_before = self._probe
        self._probe = None
        r = read_steps(rows, self.max_staleness, self.num_generations)
        slower = slowdown(times_before, [row["perf/step_s"] for row in rows])
        if slower <= self.config.max_loss and r.waste_share <= self.config.waste_high:
            # the raise cost nothing that noise does not explain: keep it, and go on if the loop still waits
            regime = classify(r, self.config)
            if regime in ("starving", "rollout", "balanced"):
                self._settled = rows
                return getattr(self, f"_on_{regime}")(step, r)
            return []
        self.ceiling = min(self.ceiling, before)  # it did harm: no raise above `before` for `reprobe_steps`
        self._ceiling_set_at = step
        why = (f"{100 * r.waste_share:.1f}% wasted after the raise" if r.waste_share > self.config.waste_high
               else f"steps {100 * slower:.0f}% slower after the raise, beyond their spread")
        return self._change(step, "inflight", before, "probe", f"{why}: reverted", r, -1)

    # -- changes --------------------------------------------------------------------------------------------------
    def _scale(self, knob: str, direction: int) -> float:
        """The step scale of `knob` for a change in `direction`: halved when that knob's last change went the
        other way (the damping that keeps it from oscillating), never below 1/8."""
        last = self._last_direction[knob]
        if last and direction != last:
            self._step_scale[knob] = max(self._step_scale[knob] / 2, 0.125)
        return self._step_scale[knob]

    def _down(self, knob: str) -> float:
        """The factor of a cut of `knob` for staleness: `down_factor`, damped after a reversal."""
        return 1 - (1 - self.config.down_factor) * self._scale(knob, -1)

    def _settling_steps(self, old: int, new: int) -> int:
        """Steps until the samples admitted under `old` in flight (and the queue beside them) are out of the
        pipeline: they are trained, or dropped, about that many steps later."""
        pipeline = max(old, new) + (self.queue_bound if new < old else 0)
        drain = math.ceil(pipeline / max(self.samples_per_step, 1))
        return max(self.config.cooldown_steps, min(drain, max(self.max_staleness, 1) + 1))

    def _change(self, step: int, knob: str, new: int, regime: str, reason: str, r: Reading,
                direction: int) -> list[Decision]:
        old = self.inflight if knob == "inflight" else self.queue_bound
        low, high = ((self.bounds.min_inflight, self.bounds.max_inflight) if knob == "inflight"
                     else (self.bounds.min_queue, self.bounds.max_queue))
        new = int(min(max(new, low), high))
        if new == old:
            return []
        queue_before = self.queue_bound
        if knob == "inflight":
            settle = self._settling_steps(old, new)
            self.inflight = new
        else:
            settle = self.config.cooldown_steps
            self.queue_cap = new
        self._last_direction[knob] = direction
        self._settled_after = step + settle
        self._rows = []
        self._streak = ("", 0)
        decision = Decision(step, knob, old, new, regime, reason, r.evidence())
        self.decisions.append(decision)
        if knob == "inflight" and self.queue_bound != queue_before:
            decision.reason += f" (the queue bound follows the budget: {queue_before} -> {self.queue_bound})"
        return [decision]

    def _recommend(self, text: str) -> None:
        if text not in self.recommendations:
            self.recommendations.append(text)


class AutotuneCallback(TrainerCallback):
    """Runs `Autotuner` at every log of the trainer, first among the callbacks (so the trackers and the metrics log
    see its `autotune/*` values), and applies its decisions to the worker's `LiveKnobs`. The step-0 clamps (made
    before the worker started) are said when training begins and recorded with the first step. `say` takes the one
    line per change (default: print, flushed)."""

    def __init__(self, tuner: Autotuner, knobs, say=None):
        self.tuner, self.knobs = tuner, knobs
        self.say = say or (lambda line: print(line, flush=True))
        self.pending: list[Decision] = []
        self._initial = list(tuner.decisions)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self._initial and not state.global_step:
            for decision in self._initial:
                self.say(decision.line())
        else:
            self._initial = []  # a resumed run said them the first time

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        decisions = self.tuner.observe(state.global_step, dict(logs))
        for decision in decisions:
            self.say(decision.line())
        self.knobs.inflight, self.knobs.queue_bound = self.tuner.inflight, self.tuner.queue_bound
        logs.update({"autotune/inflight": float(self.tuner.inflight),
                     "autotune/queue_bound": float(self.tuner.queue_bound)})
        self.pending, self._initial = self._initial + decisions, []
        if self.pending:  # the step-0 clamps count with the first step, as its row records them
            logs["autotune/changes_total"] = float(len(self.pending))
        if decisions:
            logs.update({f"autotune/{k}": float(v) for k, v in decisions[-1].evidence.items()})

    def row_extra(self) -> dict:
        """What `LoopRecorder` adds to this step's row: the decisions taken at it, with their evidence."""
        return {"autotune": [asdict(d) for d in self.pending]} if self.pending else {}
