import statistics

from grpo_lab.serving.routing_policy import AFFINITY, SPILLED, UNMATCHED
from grpo_lab.serving.routing_sim import SimConfig, replay
from grpo_lab.serving.trace import TraceConfig, generate_trace, make_prompts


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
