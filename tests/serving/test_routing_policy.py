import pytest

from grpo_lab.serving.routing.prefix_hash import block_hashes
from grpo_lab.serving.routing.prefix_affinity import AFFINITY, SPILLED, UNMATCHED, PrefixAffinityPolicy, RoutingConfig

TEMPLATE = list(range(1000, 1023))  # 23 shared tokens, as the qwen_math template


def prompt(i, n=80):
    return TEMPLATE + [i * 100 + t for t in range(n)]


def h(tokens, ns="v1"):
    return block_hashes(tokens, ns)


def test_group_stays_on_one_replica_while_in_flight():
    policy = PrefixAffinityPolicy(2)
    group = [policy.route(h(prompt(1)), [0, 1]) for _ in range(8)]
    assert group[0].kind == UNMATCHED
    assert {d.kind for d in group[1:]} == {AFFINITY}
    assert len({d.replica for d in group}) == 1  # pending claims keep the group together


def test_failed_request_leaves_no_ownership():
    policy = PrefixAffinityPolicy(2)
    d = policy.route(h(prompt(1)), [0, 1])
    policy.finish(d, ok=False)
    assert policy.in_flight == [0, 0]
    assert policy.route(h(prompt(1)), [0, 1]).kind == UNMATCHED


def test_ownership_after_success_and_finish_idempotent():
    policy = PrefixAffinityPolicy(2)
    d = policy.route(h(prompt(1)), [0, 1])
    policy.finish(d, ok=True)
    policy.finish(d, ok=True)
    assert policy.in_flight == [0, 0]
    again = policy.route(h(prompt(1)), [0, 1])
    assert again.kind == AFFINITY and again.replica == d.replica


def test_template_prefix_is_common_and_does_not_attract():
    policy = PrefixAffinityPolicy(2)
    first = policy.route(h(prompt(1)), [0, 1])
    policy.finish(first, ok=True)
    other = policy.route(h(prompt(2)), [0, 1])  # shares only the template block with prompt 1
    assert other.kind == UNMATCHED and other.replica != first.replica  # least loaded, round robin


def test_spill_when_affine_replica_is_too_far_ahead():
    policy = PrefixAffinityPolicy(2, RoutingConfig(spill_threshold=2))
    kinds = [policy.route(h(prompt(1)), [0, 1]) for _ in range(5)]
    assert [d.kind for d in kinds] == [UNMATCHED, AFFINITY, AFFINITY, SPILLED, AFFINITY]
    # the 4th would put replica A 3 ahead (> K=2); it went to B, so the 5th sees A 2 ahead again
    assert kinds[3].replica != kinds[0].replica


def test_only_candidates_are_chosen_and_forget_replica():
    policy = PrefixAffinityPolicy(3)
    d = policy.route(h(prompt(1)), [0, 1, 2])
    policy.finish(d, ok=True)
    others = [r for r in range(3) if r != d.replica]
    assert policy.route(h(prompt(1)), others).replica in others  # the owner is out of service
    policy.forget_replica(d.replica)
    assert policy.route(h(prompt(1)), [d.replica]).matched_blocks == 0
    with pytest.raises(ValueError):
        policy.route(h(prompt(1)), [])


def test_least_loaded_ignores_non_candidates():
    policy = PrefixAffinityPolicy(2)
    for i in range(4):
        policy.route(h(prompt(10 + i)), [1])  # replica 1 busy
    assert policy.route(h(prompt(99)), [0, 1]).replica == 0


def test_lru_bounds_memory():
    policy = PrefixAffinityPolicy(2, RoutingConfig(max_blocks=50))
    for i in range(200):
        policy.finish(policy.route(h(prompt(i)), [0, 1]), ok=True)
    assert policy.num_blocks <= 50


def test_lru_evicts_a_prompt_from_its_tail_so_its_prefix_still_matches():
    policy = PrefixAffinityPolicy(2, RoutingConfig(max_blocks=6))
    tokens = list(range(1000, 1000 + 16 * 4 + 1))  # 4 full blocks
    first = policy.route(h(tokens), [0, 1])
    policy.finish(first, ok=True)
    for q in range(3):  # three one-block prompts: 7 records for 6 slots, so one of the prompt's is evicted
        policy.finish(policy.route(h([q] * 17), [0, 1]), ok=True)
    again = policy.route(h(tokens), [0, 1])
    assert (again.kind, again.replica, again.matched_blocks) == (AFFINITY, first.replica, 3)


def test_versions_do_not_share_blocks():
    policy = PrefixAffinityPolicy(2)
    policy.finish(policy.route(h(prompt(1), "v1"), [0, 1]), ok=True)
    assert policy.route(h(prompt(1), "v2"), [0, 1]).kind == UNMATCHED


def test_config_validation():
    with pytest.raises(ValueError):
        RoutingConfig(block_size=0)
    with pytest.raises(ValueError):
        RoutingConfig(spill_threshold=-1)


def test_launcher_builds_the_vllm_contract():
    from grpo_lab.serving.adapters.slots import max_loras_for
    from grpo_lab.serving.replicas.vllm_launcher import router_command
    from grpo_lab.serving.replicas.vllm_spec import VLLMReplicaSpec, replica_specs, round_lora_rank

    assert [round_lora_rank(r) for r in (1, 2, 8, 9, 300)] == [1, 8, 8, 16, 320]
    spec = VLLMReplicaSpec(model="Qwen/Qwen2.5-Math-1.5B", lora_rank=4, max_staleness=4, gpu=1)
    cmd = spec.command()
    assert cmd[:3] == ["vllm", "serve", "Qwen/Qwen2.5-Math-1.5B"]
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8" and cmd[cmd.index("--max-loras") + 1] == str(max_loras_for(4))
    assert "--enable-lora" in cmd and "trl-policy-v0" in cmd and "processed_logprobs" in cmd
    env = spec.env({"MY_TOKEN": "secret"})
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "secret" not in " ".join(cmd) and "secret" not in spec.shell_line()
    specs = replica_specs("m", 2, base_port=9001)
    assert router_command(specs).endswith("--replica http://127.0.0.1:9001 --replica http://127.0.0.1:9002 --port 8000")


def test_pool_refuses_inconsistent_or_data_parallel_replicas():
    from grpo_lab.serving.wire.metrics import Registry
    from grpo_lab.serving.router.replica_pool import ReplicaPool
    from grpo_lab.serving.router.config import RouterConfig

    pool = ReplicaPool(RouterConfig(replicas=["http://127.0.0.1:1", "http://127.0.0.1:2"]), client=None,
                       metrics=Registry())
    info = {"model_config": {"model": "m", "max_model_len": 4096, "dtype": "torch.bfloat16"},
            "cache_config": {"block_size": 16}, "parallel_config": {"data_parallel_size": 1},
            "lora_config": {"max_lora_rank": 8, "max_loras": 6}}
    assert pool._inconsistency(info) is None
    pool.reference_info = info
    assert pool._inconsistency(info) is None
    other = {**info, "lora_config": {"max_lora_rank": 8, "max_loras": 4}}
    assert "lora_config.max_loras" in pool._inconsistency(other)
    dp = {**info, "parallel_config": {"data_parallel_size": 2}}
    assert "data_parallel_size" in pool._inconsistency(dp)


def test_router_config_validation_and_token_sources(tmp_path, monkeypatch):
    from grpo_lab.serving.router.config import RouterConfig

    with pytest.raises(ValueError, match="at least one replica"):
        RouterConfig(replicas=[])
    with pytest.raises(ValueError, match="http"):
        RouterConfig(replicas=["127.0.0.1:8001"])
    with pytest.raises(ValueError, match="duplicate"):
        RouterConfig(replicas=["http://a:1", "http://a:1/"])
    monkeypatch.setenv("SOME_TOKEN_ENV", "abc")
    config = RouterConfig(replicas=["http://a:1"], api_key_env="SOME_TOKEN_ENV")
    assert config.read_api_key() == "abc" and "abc" not in repr(config)
    (tmp_path / "t").write_text("fromfile\n")
    assert RouterConfig(replicas=["http://a:1"], api_key_file=str(tmp_path / "t")).read_api_key() == "fromfile"


def test_metrics_text_format():
    from grpo_lab.serving.wire.metrics import Registry, parse_text

    reg = Registry()
    reg.inc("x_total", "help", replica='a"b')
    reg.observe("lat_seconds", "help", 0.02, buckets=(0.01, 0.1))
    text = reg.render()
    assert '# TYPE x_total counter' in text and 'x_total{replica="a\\"b"} 1' in text
    values = parse_text(text)
    assert values['lat_seconds_bucket{le="0.01"}'] == 0 and values['lat_seconds_bucket{le="+Inf"}'] == 1
    assert values["lat_seconds_count"] == 1


def test_refused_requests_leave_no_record():
    """Only answered requests create LRU records: a flood of refused ones cannot evict the useful ones."""
    policy = PrefixAffinityPolicy(2, RoutingConfig(max_blocks=1000))
    kept = policy.route(h(prompt(1)), [0, 1])
    policy.finish(kept, ok=True)
    records = policy.num_blocks
    for i in range(200):
        policy.finish(policy.route(h(prompt(100 + i)), [0, 1]), ok=False)
    assert policy.num_blocks == records and policy.num_pending == 0
    assert policy.route(h(prompt(1)), [0, 1]).replica == kept.replica


def test_record_memory():
    """The documented bytes per LRU record (module docstring: about 145 B) hold, key and LRU entry included."""
    import random
    import tracemalloc

    policy = PrefixAffinityPolicy(4, RoutingConfig(max_blocks=1_000_000))
    rng = random.Random(0)
    prompts = [[rng.randrange(150_000) for _ in range(16 * 8 + 1)] for _ in range(2500)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i, p in enumerate(prompts):
        policy.finish(policy.route(h(p, "v1"), [0, 1, 2, 3]), ok=True)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    per_record = grown / policy.num_blocks
    assert policy.num_blocks == 2500 * 8
    assert per_record < 175, per_record
