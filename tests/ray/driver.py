"""A trainer stand-in for the teardown tests: joins the cluster, starts replicas, prints where they are, waits.

    python driver.py <ray address>       # prints one JSON line (the replicas' info), then sleeps until killed
"""

import json
import sys
import time

from grpo_lab.serving.clusters.ray_actor import ServerSpec
from grpo_lab.serving.clusters.ray_replicas import RayReplicas

with RayReplicas(2, ServerSpec("fake"), address=sys.argv[1], resources={"replica_node": 1}) as replicas:
    print(json.dumps(replicas.infos()), flush=True)
    time.sleep(600)
