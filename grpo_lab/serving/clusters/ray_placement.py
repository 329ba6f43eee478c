"""Where Ray may put the replicas: the resources each asks for, the trainer's node kept free, and a placement no node
can meet refused at once.

The trainer's node is the one that declares `TRAINER_NODE_RESOURCE` (with Ray Client the driver runs on the head).
Ray keeps a placement group no node could hold pending forever, hence the check first (docs/clusters.md).
"""

from __future__ import annotations

import inspect
import math

TRAINER_NODE_RESOURCE = "trainer_node"  # the custom resource that marks the trainer's node(s)
NODE_ID_LABEL = "ray.io/node-id"  # Ray's built-in label of every node (ray.util.placement_group.NODE_ID_LABEL_KEY)
RESERVED = ("CPU", "GPU", "memory", "object_store_memory")  # set by the replica kind, not by `resources`


class PlacementError(RuntimeError):
    """The cluster cannot place the replicas as asked; `str()` is one line saying what was asked and what there is."""


def parse_resources(text: str) -> dict[str, float]:
    """`"inference=1,accel_a100=0.5"` -> `{"inference": 1.0, "accel_a100": 0.5}`; ValueError (one phrase) for
    anything else: a missing `=`, an empty name, an amount that is not a positive finite number, a name given twice,
    or one of Ray's own resources (CPU and GPU follow from the replica kind)."""
    amounts: dict[str, float] = {}
    for part in (p.strip() for p in str(text).split(",")):
        name, sep, amount = part.partition("=")
        name = name.strip()
        if not sep or not name or any(c.isspace() for c in name):
            raise ValueError(f"{part!r} is not NAME=AMOUNT (e.g. inference=1; several: a=1,b=0.5)")
        if name in RESERVED:
            raise ValueError(f"{name} is set by the replica kind (a CPU each, a GPU for vLLM on GPUs); give custom "
                             "resources only")
        if name in amounts:
            raise ValueError(f"{name} is given twice")
        try:
            value = float(amount)
        except ValueError:
            raise ValueError(f"{part!r}: {amount.strip()!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{part!r}: the amount must be a positive number")
        amounts[name] = value
    return amounts


def _fits(bundle: dict, offered: dict) -> bool:
    return all(offered.get(name, 0.0) >= amount for name, amount in bundle.items() if amount)


def _describe(nodes: list[dict]) -> str:
    def one(node):
        shown = {k: v for k, v in node["Resources"].items() if not k.startswith("node:") and "memory" not in k}
        return f"{node.get('NodeManagerAddress', node['NodeID'][:8])} {shown}"
    return "; ".join(one(n) for n in nodes) or "no live node"


def placement_options(ray, bundle: dict, replicas: int, strategy: str, avoid_resource: str | None) -> dict:
    """The extra `placement_group(...)` arguments that keep the replicas off nodes declaring `avoid_resource` (none
    when no node declares it), after checking that the live nodes could ever hold `replicas` bundles of `bundle`
    with `strategy`; PlacementError (one line) when they could not."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    avoided = [n for n in nodes if avoid_resource and n["Resources"].get(avoid_resource, 0) > 0]
    eligible = [n for n in nodes if n not in avoided]
    fitting = [n for n in eligible if _fits(bundle, n["Resources"])]
    needed = replicas if strategy == "STRICT_SPREAD" else 1
    if len(fitting) < needed:
        kept_off = (f"; the trainer's node ({avoid_resource}) is kept free: --replicas-on-trainer-node allows it"
                    if avoided and any(_fits(bundle, n["Resources"]) for n in avoided) else "")
        what = f"{needed} nodes" if needed > 1 else "any node"
        raise PlacementError(f"no placement for {replicas} replica(s) of {bundle} ({strategy}): {what} must offer "
                             f"that, and {len(fitting)} does ({_describe(nodes)}){kept_off}")
    if not avoided:
        return {}
    from ray.util.placement_group import placement_group  # Ray is optional (the `ray` extra): only once placing

    if "bundle_label_selector" not in inspect.signature(placement_group).parameters:
        raise PlacementError(f"Ray {ray.__version__} cannot keep replicas off the trainer's node (no bundle label "
                             "selectors): upgrade Ray, or allow it with --replicas-on-trainer-node")
    ids = sorted(n["NodeID"] for n in avoided)
    selector = f"!{ids[0]}" if len(ids) == 1 else f"!in({', '.join(ids)})"
    return {"bundle_label_selector": [{NODE_ID_LABEL: selector}] * replicas}
