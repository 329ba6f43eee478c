"""Issue 43 #8, placement on the two-node cluster: the async loop keeps its replicas off the trainer's node (the head
declares `trainer_node`) with no resource asked for, and a placement no node can hold fails at once with one line
(it used to wait out the ready timeout, or forever) and leaves no placement group."""

from __future__ import annotations

import pytest
from ray_checks import live_placement_groups, wait_no_live_actors, wait_torn_down

from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args
from grpo_lab.serving.clusters.ray_actor import ServerSpec
from grpo_lab.serving.clusters.ray_placement import TRAINER_NODE_RESOURCE, PlacementError
from grpo_lab.serving.clusters.ray_replicas import RayReplicas
from grpo_lab.tasks.embedded_model import embedded_model_dir

ray = pytest.importorskip("ray", reason="the Ray tier needs Ray: pip install 'grpo-lab[ray]'")
pytestmark = pytest.mark.ray


def test_the_loops_replicas_keep_off_the_trainers_node_by_default(ray_cluster, tmp_path):
    """No `ray_resources`: two one-CPU replicas would be SPREAD over the head (one CPU) and the worker; the head
    declares `trainer_node`, so both land on the worker."""
    args = embedded_trainer_args(str(tmp_path / "run"), max_steps=1, save_strategy="no")
    loop = AsyncLoop(LoopConfig(replicas=2, launcher="ray", ray_address=ray_cluster.address,
                                model=str(embedded_model_dir()), ready_timeout_s=240), args, progress=False)
    infos = []
    try:
        loop._start_cluster(loop.loop.model)
        infos = loop.cluster.replicas.infos()
        assert {i["node_id"] for i in infos} == {ray_cluster.worker_node}, infos
    finally:
        loop.stop()
    assert wait_torn_down(infos) == [] and wait_no_live_actors(ray) == [] and live_placement_groups(ray) == []


def test_allowed_on_the_trainers_node_a_replica_may_land_there(ray_cluster):
    """`--replicas-on-trainer-node` (no node avoided): STRICT_SPREAD puts one replica on each node, the head too."""
    with RayReplicas(2, ServerSpec("fake"), strategy="STRICT_SPREAD") as replicas:
        infos = replicas.infos()
        assert {i["node_id"] for i in infos} == {ray_cluster.worker_node, ray_cluster.head_node}
    assert wait_torn_down(infos) == []


@pytest.mark.parametrize("resources, why", [
    ({"inference": 1}, "0 does"),  # no node declares it
    ({TRAINER_NODE_RESOURCE: 1}, "--replicas-on-trainer-node allows it"),  # only the trainer's node has it
    ({"replica_node": 5}, "0 does"),  # the worker has 4
])
def test_a_placement_no_node_can_hold_fails_at_once_in_one_line(ray_cluster, resources, why):
    replicas = RayReplicas(1, ServerSpec("fake"), resources=resources, avoid_resource=TRAINER_NODE_RESOURCE,
                           ready_timeout_s=60)  # unfixed: a TimeoutError after 60 s, or a pending group forever
    with pytest.raises(PlacementError) as refused:
        replicas.start()
    message = str(refused.value)
    assert "\n" not in message and why in message and str(resources)[1:-1] in message, message
    assert live_placement_groups(ray) == [] and replicas.placement_group is None


def test_the_command_names_the_placement_it_cannot_make(ray_cluster, tmp_path, capsys):
    """`--replica-resources nowhere=1` on a cluster without it: exit 1, one error line, nothing left."""
    from grpo_lab.async_loop import command

    code = command.main(["--launcher", "ray", "--ray-address", ray_cluster.address, "--replica-resources",
                         "nowhere=1", "--max-steps", "1", "--output-dir", str(tmp_path / "run")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert code == 1 and len(errors) == 1 and "PlacementError: no placement" in errors[0], errors
    assert "'nowhere': 1.0" in errors[0]
    assert wait_no_live_actors(ray) == [] and live_placement_groups(ray) == []
