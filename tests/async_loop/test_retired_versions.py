"""A rollout answered "no such adapter" is lost only when the trainer could still have used it.

The router unloads (or cuts the drain of) a policy version once TRL has moved more than `max_staleness` past it;
rollouts of that version answered 404 are the designed end of their group (abandoned, as the trainer would drop
their samples). A 404 for a version still inside the window is a rollout lost, and the chaos run counts it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections import defaultdict

import pytest

from grpo_lab.async_loop import rollout_worker
from grpo_lab.async_loop.rollout_worker import LabRolloutLoop, StaleAdapter


def _loop(model_version: int, max_staleness: int) -> LabRolloutLoop:
    loop = object.__new__(LabRolloutLoop)  # only the version bookkeeping is exercised, no TRL child is started
    loop._model_version_value = multiprocessing.Value("i", model_version)  # what the trainer shares
    loop.max_staleness = max_staleness
    loop.group_consistent_versions, loop._limiter = True, None
    loop._group_versions, loop._abandoned, loop._counters = {}, set(), defaultdict(float)
    return loop


@pytest.mark.parametrize("group_version, lost", [(1, 0), (5, 1)])
def test_a_404_is_lost_only_inside_the_staleness_window(monkeypatch, group_version, lost):
    async def unloaded(self, prompt, tool_dict=None, tools=None, group_id=0):
        raise StaleAdapter(f"trl-policy-v{group_version}")

    monkeypatch.setattr(rollout_worker._AsyncRolloutLoop, "_generate_one", unloaded)
    loop = _loop(model_version=7, max_staleness=4)  # v1 is 6 behind (retired), v5 is 2 behind (in the window)
    loop._group_versions[3] = group_version
    answer = asyncio.run(loop._generate_pinned([1, 2], None, None, group_id=3))
    assert answer == ([], [], [], 0, 0, None)
    assert 3 in loop._abandoned  # either way the group's other rollouts are not sent
    assert loop._counters["rollout/stale_adapter_total"] == lost


class _Router:
    """The trainer's vLLM client, standing in for the router: an unloaded version is answered 404 at once, so a
    rollout of it arriving now meets `StaleAdapter` in the worker (run right there, inside the unload)."""

    def __init__(self, loop: LabRolloutLoop):
        self.loop = loop
        self.loaded: list[str] = []
        self.met_404: list[tuple[int, int]] = []  # (version unloaded, the worker's version at its 404)

    def pause(self):
        pass

    def resume(self):
        pass

    def draining_adapters(self):
        return set()

    def load_lora_adapter(self, name, path):
        self.loaded.append(name)

    def unload_lora_adapter(self, name):
        self.loaded.remove(name)
        version = int(name.rsplit("-v", 1)[1])
        group_id = 100 + version  # a group pinned to the version being retired: its rollout meets 404 now
        self.loop._group_versions[group_id] = version
        self.met_404.append((version, self.loop.model_version))
        asyncio.run(self.loop._generate_pinned([1, 2], None, None, group_id=group_id))


def test_the_trainer_moves_the_worker_on_before_it_retires_a_version(monkeypatch, tmp_path):
    """The trainer unloads `v(N - max_staleness - 1)` when it publishes `vN`. A rollout of the retired version
    answered 404 from that moment must find the worker already at `vN` (its group ends by design); told `vN` only
    after the unload, the worker judged the 404 against `v(N-1)`, where the retired version is still inside the
    window, and counted it lost (the flaky `rollouts_lost` of the chaos run's `worker_partition`: after the heal,
    rollouts pinned to old versions were still being retried while the trainer retired them)."""
    from types import SimpleNamespace

    from grpo_lab.async_loop import trainer as trainer_module
    from grpo_lab.async_loop.trainer import AsyncGRPOLabTrainer
    from grpo_lab.serving.adapters.storage import AdapterStore

    async def unloaded(self, prompt, tool_dict=None, tools=None, group_id=0):
        raise StaleAdapter("an unloaded version")

    monkeypatch.setattr(rollout_worker._AsyncRolloutLoop, "_generate_one", unloaded)

    def save_lora_adapter(model, accelerator, adapter_name, dest_dir):
        os.makedirs(dest_dir, exist_ok=True)
        with open(os.path.join(dest_dir, "adapter_config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(trainer_module, "save_lora_adapter", save_lora_adapter)
    max_staleness = 4
    loop = _loop(model_version=0, max_staleness=max_staleness)
    trainer = object.__new__(AsyncGRPOLabTrainer)  # only the weight sync runs: no model, no TRL worker
    trainer.accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None,
                                          unwrap_model=lambda model: model)
    trainer.model, trainer._adapter_name, trainer._lora_name = None, "default", "trl-policy"
    trainer.args = SimpleNamespace(max_staleness=max_staleness)
    trainer.state = SimpleNamespace(global_step=0)
    trainer.adapter_store = AdapterStore(tmp_path / "adapters")
    trainer.vllm_client = router = _Router(loop)
    trainer.rollout_worker = SimpleNamespace(update_model_version=lambda v: setattr(loop._model_version_value,
                                                                                     "value", v))
    trainer.model_version, trainer._reconciled, trainer._live_versions, trainer.published = 0, True, [], []
    for step in range(1, 10):
        trainer.state.global_step = step
        trainer._sync_weight_lora(0.0)
    assert trainer.model_version == loop.model_version == 9
    assert router.loaded == [f"trl-policy-v{v}" for v in range(5, 10)]  # v5..v9: the window of v9
    assert [v for v, _ in router.met_404] == [1, 2, 3, 4]
    # nothing the trainer could use was lost: each 404 met a worker already past the retired version's window
    assert loop._counters["rollout/stale_adapter_total"] == 0, router.met_404
    assert all(worker - v > max_staleness for v, worker in router.met_404), router.met_404
    assert loop._abandoned == {101, 102, 103, 104}  # each retired version's group ended, by design
