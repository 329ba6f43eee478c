"""A rollout answered "no such adapter" is lost only when the trainer could still have used it.

The router unloads (or cuts the drain of) a policy version once TRL has moved more than `max_staleness` past it;
rollouts of that version answered 404 are the designed end of their group (abandoned, as the trainer would drop
their samples). A 404 for a version still inside the window is a rollout lost, and the chaos run counts it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
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
