import statistics

from grpo_lab.serving.routing.prefix_affinity import AFFINITY, SPILLED, UNMATCHED
from grpo_lab.serving.sim.routing_sim import SimConfig, replay
from grpo_lab.serving.sim.trace import TraceConfig, generate_trace, make_prompts


def test_trace_shape():
    config = TraceConfig(num_prompts=400, seed=3)
    prompts = make_prompts(config)
    lengths = sorted(len(p) for p in prompts)
    assert all(p[:23] == prompts[0][:23] for p in prompts)
    assert 80 <= statistics.median(lengths) <= 110
    assert 190 <= lengths[int(0.9 * len(lengths))] <= 290
    assert lengths[0] >= config.min_prompt_tokens and lengths[-1] <= config.max_prompt_tokens
    trace = generate_trace(TraceConfig(num_prompts=50, num_groups=120, seed=3))
    assert len(trace) == 120 and all(len(g.completion_tokens) == 8 for g in trace)
    assert sorted(g.prompt_index for g in trace[:50]) == list(range(50))  # each epoch visits every prompt
    assert generate_trace(TraceConfig(num_prompts=50, num_groups=5, seed=3))[0].prompt_ids == trace[0].prompt_ids


def test_replay_beats_round_robin_on_a_small_trace():
    trace = generate_trace(TraceConfig(num_prompts=200, num_groups=400, seed=1))
    prefix = replay(trace, SimConfig(num_replicas=2, max_in_flight=128), "prefix")
    rr = replay(trace, SimConfig(num_replicas=2, max_in_flight=128), "round_robin")
    assert prefix.requests == rr.requests == 3200
    assert prefix.share(UNMATCHED) >= 0.125 - 1e-9  # the first rollout of each group cannot match
    assert prefix.share(AFFINITY) > 0.84 and prefix.share(SPILLED) < 0.02
    assert rr.cacheable_prefill_tokens > 1.8 * prefix.cacheable_prefill_tokens
    assert prefix.max_in_flight_seen <= 128
    assert abs(prefix.per_replica[0] - prefix.per_replica[1]) < 0.1 * prefix.requests


def test_rollout_arrivals_reach_the_unmatched_floor():
    """With TRL's one-rollout-per-free-slot arrivals, groups straddle version bumps; the router still matches every
    request that any replica could serve (unmatched == the first request of each adapter+prompt)."""
    trace = generate_trace(TraceConfig(num_prompts=200, num_groups=400, seed=2))
    result = replay(trace, SimConfig(max_in_flight=128, arrivals="rollout"), "prefix")
    assert result.share(UNMATCHED) == result.unmatched_floor > 0.125
    assert result.share(SPILLED) < 0.02


def test_group_consistent_versioning_brings_unmatched_to_one_in_g():
    """One version per group (grpo_lab's async loop): no group straddles a sync, so the unmatched floor is 1/G even
    with TRL's one-rollout-per-slot arrivals, and more prefill is saved than with per-rollout versions."""
    trace = generate_trace(TraceConfig(num_prompts=200, num_groups=400, seed=2))
    per_rollout = replay(trace, SimConfig(max_in_flight=128, arrivals="rollout"), "prefix", memo_hashes=True)
    per_group = replay(trace, SimConfig(max_in_flight=128, arrivals="rollout", versioning="group"), "prefix",
                       memo_hashes=True)
    rr = replay(trace, SimConfig(max_in_flight=128, arrivals="rollout", versioning="group"), "round_robin")
    assert per_group.unmatched_floor == per_group.share(UNMATCHED) == 0.125
    assert per_rollout.unmatched_floor > 0.125
    assert per_group.prefill_tokens < per_rollout.prefill_tokens < rr.prefill_tokens


def test_kv_capacity_shared_with_running_requests_evicts_and_queues():
    trace = generate_trace(TraceConfig(num_prompts=100, num_groups=150, seed=4))
    roomy = replay(trace, SimConfig(cache_blocks=10**6, cache_holds_running=True), "prefix", memo_hashes=True)
    tight = replay(trace, SimConfig(cache_blocks=150, cache_holds_running=True), "prefix", memo_hashes=True)
    prefix_only = replay(trace, SimConfig(cache_blocks=150), "prefix", memo_hashes=True)
    assert roomy.evictions == 0 and roomy.kv_waits == 0
    assert tight.kv_waits > 0 and tight.evictions > 0 and tight.makespan_s > roomy.makespan_s
    assert prefix_only.kv_waits == 0 and prefix_only.evictions > 0
    assert tight.requests == roomy.requests == 1200


def test_blog_proxy_policy_counts_template_only_matches_as_affinity():
    """The published proxy's rule (ownership at routing time; the routed request is no successor yet): the second
    prompt under a new adapter version 'matches' the first one's replica on the shared template block alone."""
    from grpo_lab.serving.routing.prefix_hash import block_hashes
    from grpo_lab.serving.routing.baselines import BlogProxyPolicy
    from grpo_lab.serving.routing.prefix_affinity import AFFINITY, PrefixAffinityPolicy

    template = list(range(1000, 1023))
    a, b = template + list(range(10, 60)), template + list(range(60, 110))
    blog, ours = BlogProxyPolicy(4), PrefixAffinityPolicy(4)
    for policy in (blog, ours):
        first = policy.route(block_hashes(a, "v1"), [0, 1, 2, 3])
        policy.finish(first, ok=True)
    second_blog = blog.route(block_hashes(b, "v1"), [0, 1, 2, 3])
    second_ours = ours.route(block_hashes(b, "v1"), [0, 1, 2, 3])
    assert (second_blog.kind, second_blog.matched_blocks) == (AFFINITY, 1)  # the template block
    assert second_ours.kind == UNMATCHED


def test_real_trace_pipeline_renders_the_chat_template(tmp_path):
    """`sanity_prompt_ids` reads a load_from_disk folder in place and tokenizes the qwen_math chat prompts; here
    with a stand-in tokenizer (the benchmark uses Qwen2.5's BPE from the `bench` extra)."""
    from datasets import Dataset, DatasetDict

    from grpo_lab.serving.sim.trace import sanity_prompt_ids
    from grpo_lab.models.chat import QWEN_MATH_SYSTEM

    DatasetDict({"train": Dataset.from_dict({"problem": ["1+1?", "What is 2+2?"], "answer": ["2", "4"]})}) \
        .save_to_disk(str(tmp_path / "sanity"))
    seen: list[str] = []

    def tokenizer(texts, add_special_tokens):
        seen.extend(texts)
        return {"input_ids": [[ord(c) for c in t] for t in texts]}

    ids = sanity_prompt_ids(str(tmp_path / "sanity"), tokenizer)
    assert len(ids) == 2 and all(QWEN_MATH_SYSTEM in t and t.endswith("<|im_start|>assistant\n") for t in seen)
    trace = generate_trace(TraceConfig(num_groups=4, group_size=3), prompts=ids)
    assert {g.prompt_index for g in trace} == {0, 1} and all(g.prompt_ids in ids for g in trace)
