"""The headless runner never waits out a cell's timeout on a finished cell, nor calls such a wait ok (issue 43 #12).

The fault is made deterministic: a shell channel that misses every wake-up (a poll notices the queued
`execute_reply` only when its timeout ends, what a lost edge of ZeroMQ's descriptor does to pyzmq's asyncio poll).
"""

from __future__ import annotations

import asyncio

import nbformat
import pytest
from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from traitlets import Type, default

from grpo_lab.lab.headless_kernel import HeadlessKernelClient, HeadlessKernelManager, SlicedPollChannel
from grpo_lab.lab.runner import NotebookFailed, run_notebook

TIMEOUT_S = 8


class DeafChannel(AsyncZMQSocketChannel):
    """Every wake-up lost: a message that has arrived is seen only when the poll's timeout ends."""

    async def get_msg(self, timeout=None):
        assert timeout is not None, "a poll without a timeout would never see its message"
        await asyncio.sleep(timeout)
        return await super().get_msg(timeout=0)


class SlicedDeafChannel(SlicedPollChannel, DeafChannel):
    """The runner's slicing over the deaf channel."""


class DeafShellClient(HeadlessKernelClient):
    shell_channel_class = Type(SlicedDeafChannel)


class DeafShellManager(HeadlessKernelManager):
    @default("client_factory")
    def _deaf_client_factory(self):
        return DeafShellClient


class UnslicedDeafShellClient(AsyncKernelClient):
    shell_channel_class = Type(DeafChannel)


class UnslicedDeafShellManager(HeadlessKernelManager):
    @default("client_factory")
    def _unsliced_client_factory(self):
        return UnslicedDeafShellClient


@pytest.fixture
def notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 41"), nbformat.v4.new_code_cell("print(x + 1)")]
    path = tmp_path / "finished_cells.ipynb"
    nbformat.write(nb, path)
    return path


def test_a_missed_wake_up_costs_a_poll_slice_not_the_cell_timeout(notebook, tmp_path):
    out = run_notebook(notebook, executed_dir=tmp_path / "executed", quick=False, timeout_s=TIMEOUT_S,
                       kernel_manager_class=DeafShellManager)
    executed = nbformat.read(out, as_version=4)
    assert executed.cells[1].outputs[0]["text"] == "42\n"
    durations = [c.metadata.papermill.duration for c in executed.cells]
    assert all(d < TIMEOUT_S for d in durations), durations  # each reply read at the next slice, not at the timeout


def test_a_cell_that_waited_out_its_timeout_is_a_failure_not_ok(notebook, tmp_path):
    with pytest.raises(NotebookFailed, match=rf"took \d+s, its whole {TIMEOUT_S}s timeout"):
        run_notebook(notebook, executed_dir=tmp_path / "executed", quick=False, timeout_s=TIMEOUT_S,
                     kernel_manager_class=UnslicedDeafShellManager)


def test_the_runner_uses_the_sliced_client_by_default():
    manager = HeadlessKernelManager()
    assert manager.client_factory is HeadlessKernelClient
    assert HeadlessKernelClient.shell_channel_class.default_value is SlicedPollChannel
