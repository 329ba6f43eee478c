"""Tree attention on TRL's packed rows equals running every sample on its own, forward and backward.

The packed row comes from TRL's own `TreeRow` (samples sharing a prompt and partial completions, so the trie has
branches at several depths); the reference runs each sample unpacked with plain causal SDPA. Log-probs of every
trained token and the gradients of every parameter must agree.
"""

import numpy as np
import pytest
import torch
from trl.experimental.async_grpo.packing import TreeRow

from grpo_lab.async_loop import tree_attention
from grpo_lab.tasks.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

TINY = TinyModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96, max_position_embeddings=64)


def samples():
    """Two groups: prompt A with three completions (two share a prefix), prompt B with two."""
    rng = np.random.default_rng(0)
    a, b = list(rng.integers(4, 20, 7)), list(rng.integers(4, 20, 5))
    shared = list(rng.integers(4, 20, 3))
    seqs = [(0, a, shared + [5, 6]), (0, a, shared + [7, 8, 9]), (0, a, [11, 12]), (1, b, [13, 14, 15, 16]),
            (1, b, [17])]
    out = []
    for group, prompt, completion in seqs:
        ids = np.array(prompt + completion)
        mask = np.array([0] * len(prompt) + [1] * len(completion))
        out.append({"input_ids": ids, "completion_mask": mask, "old_log_probs": np.zeros(len(ids), np.float32),
                    "advantage": 1.0, "group_id": group, "metrics": {}})
    return out


def per_token_logps(model, ids, positions, labels, **kwargs):
    logits = model(input_ids=ids[None], position_ids=positions[None], **kwargs).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)


def test_sdpa_tree_attention_equals_unpacked():
    torch.manual_seed(0)
    model = build_tiny_model(build_char_tokenizer(), TINY, seed=0).double()
    row = TreeRow()
    for s in samples():
        row.add(s)
    packed = row.pack()
    assert packed["input_ids"].numel() < sum(len(s["input_ids"]) for s in samples())  # the trie shares tokens

    tree_attention.install(model, "sdpa")
    assert model.config._attn_implementation == "grpo_lab_tree_sdpa"
    max_q, max_k = packed["tree_max_seqlens"].tolist()
    tree = {k: packed[k] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    logits = model(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
                   tree_max_seqlen_q=max_q, tree_max_seqlen_k=max_k, **tree).logits[0]
    targets = packed["shift_labels"][packed["token_index"]]
    tree_lp = torch.log_softmax(logits, -1)[packed["token_index"]].gather(-1, targets[:, None]).squeeze(-1)
    tree_lp.sum().backward()
    tree_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    model.set_attn_implementation("sdpa")
    ref = []
    for s in samples():
        ids = torch.tensor(s["input_ids"])
        lp = per_token_logps(model, ids[:-1], torch.arange(len(ids) - 1), ids[1:])
        ref.append(lp[torch.tensor(s["completion_mask"][1:]).bool()])
    ref_lp = torch.cat(ref)
    ref_lp.sum().backward()
    torch.testing.assert_close(tree_lp, ref_lp, atol=1e-10, rtol=1e-10)
    # Qwen2's RMSNorm upcasts to float32, so where the trie shares a token the summed gradient is rounded at
    # float32 in one order and per sample in the other: the gradients agree to float32 precision, not float64's.
    for name, param in model.named_parameters():
        torch.testing.assert_close(tree_grads[name], param.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_layout_matches_ancestry():
    row = TreeRow()
    for s in samples():
        row.add(s)
    p = row.pack()
    n = p["input_ids"].numel()
    layout = tree_attention.TreeLayout.from_trl(p["tree_kv_index"], p["tree_cu_seqlens_q"], p["tree_cu_seqlens_k"], n)
    torch.testing.assert_close(layout.depth, p["position_ids"])  # depth in the trie is the position in the sample
    mask = layout.dense_mask()
    assert mask.diagonal().all() and not mask.triu(1).any()
    # each row attends to exactly its sample's earlier tokens: as many keys as its depth + 1
    torch.testing.assert_close(mask.sum(1), p["position_ids"] + 1)
    windowed = layout.dense_mask(sliding_window=3)
    torch.testing.assert_close(windowed.sum(1), (p["position_ids"] + 1).clamp(max=3))
    assert not (windowed & ~mask).any()


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_flex_mask_on_a_row_padded_to_the_block_size_is_the_tree_mask(sliding_window):
    """flex pads every row to a multiple of 128 (short rows compiled to a decoding kernel with no valid
    configuration on the H200): real queries see exactly their ancestors, padding keys are seen by no real query,
    and every padding query sees something (its output stays finite before it is dropped)."""
    from torch.nn.attention.flex_attention import create_mask

    row = TreeRow()
    for s in samples():
        row.add(s)
    p = row.pack()
    n = p["input_ids"].numel()
    n_pad = tree_attention._padded_length(n)
    assert n < 128 and n_pad == 128 and tree_attention._padded_length(256) == 256
    layout = tree_attention.TreeLayout.from_trl(p["tree_kv_index"], p["tree_cu_seqlens_q"], p["tree_cu_seqlens_k"], n)
    padded = tree_attention._pad_layout(layout, n_pad)
    mask = create_mask(tree_attention._mask_mod(padded, sliding_window), None, None, n_pad, n_pad, device="cpu")[0, 0]
    torch.testing.assert_close(mask[:n, :n], layout.dense_mask(sliding_window))
    assert not mask[:n, n:].any() and mask[n:].any(1).all()


def test_resolve_on_cpu():
    assert tree_attention.resolve("auto", "cpu") == "sdpa"
    assert tree_attention.resolve("sdpa", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="CUDA"):
        tree_attention.resolve("flex", "cpu")
    with pytest.raises(ValueError, match="must be one of"):
        tree_attention.resolve("flash", "cpu")


@pytest.mark.gpu
def test_flex_equals_sdpa_on_gpu():
    """FlexAttention with the tree BlockMask equals the dense-mask SDPA, forward and backward (float32, TF32 off)."""
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    row = TreeRow()
    for s in samples():
        row.add(s)
    p = {k: v.to(device) for k, v in row.pack().items()}
    n = p["input_ids"].numel()
    # laid out as a decoder layer hands them over: [1, n, heads, 32] projections viewed as [1, heads, n, 32]
    # (the loop's first H200 run failed on exactly these strides at n < 128, before rows were padded)
    q_rows = torch.randn(1, n, 4, 32, device=device, dtype=torch.float32, requires_grad=True)
    k_rows = torch.randn(1, n, 2, 32, device=device, dtype=torch.float32, requires_grad=True)
    v = torch.randn(1, 2, n, 32, device=device, dtype=torch.float32, requires_grad=True)
    q, k = q_rows.transpose(1, 2), k_rows.transpose(1, 2)
    tree = {key: p[key] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    outs, grads = [], []
    for fn in (tree_attention.sdpa_tree_attention, tree_attention.flex_tree_attention):
        out, _ = fn(None, q, k, v, None, scaling=32 ** -0.5, **tree)
        (g,) = torch.autograd.grad(out.square().sum(), [q_rows])
        outs.append(out.detach())
        grads.append(g)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=2e-5, rtol=2e-5)
