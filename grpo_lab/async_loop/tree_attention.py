"""Tree attention for TRL's packed async training rows, without the Hub kernel: SDPA (CPU, any GPU) or FlexAttention.

TRL 1.16 packs a micro-batch into a prefix trie (`TreeRow`) and runs its attention with a Hub flash-attention-3
kernel (`tree_fa3`), which needs the network and a Hopper GPU. The mask is simple: packed position `q` may attend to
`k` iff `k` is `q` or one of its ancestors; segments are in DFS pre-order, so the rule is
`on_path[segment(q), k] and k <= q`. `sdpa` computes it as a dense mask (everywhere, CPU backward too; O(N²) memory),
`flex` as a FlexAttention `BlockMask` (CUDA, scales to 16k-token rows), `fa3` leaves TRL's kernel. `install(model,
choice)` replaces TRL's `"tree_fa3"`; `resolve("auto")` picks fa3 where it can run, else flex on CUDA, else sdpa.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from ..lab import environment

log = logging.getLogger(__name__)

CHOICES = ("auto", "sdpa", "flex", "fa3")


@dataclass
class TreeLayout:
    """Where each packed position sits in the trie: its segment, its depth, and which positions each segment sees."""

    segment_of: torch.Tensor  # [N] segment index of every packed position
    on_path: torch.Tensor  # [S, N] bool: position k lies on segment s's root-to-segment path
    depth: torch.Tensor  # [N] depth in the trie (the position the token had in its sample)

    @classmethod
    def from_trl(cls, tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, n: int) -> "TreeLayout":
        device = tree_kv_index.device
        cu_q = tree_cu_seqlens_q.to(device=device, dtype=torch.long)
        cu_k = tree_cu_seqlens_k.to(device=device, dtype=torch.long)
        seg_lens, path_lens = cu_q.diff(), cu_k.diff()
        segments = torch.arange(seg_lens.numel(), device=device)
        if int(cu_q[-1]) != n:
            raise ValueError(f"tree segments cover {int(cu_q[-1])} positions but the row has {n}")
        segment_of = torch.repeat_interleave(segments, seg_lens)
        on_path = torch.zeros(seg_lens.numel(), n, dtype=torch.bool, device=device)
        on_path[torch.repeat_interleave(segments, path_lens), tree_kv_index.long()] = True
        offset = torch.arange(n, device=device) - cu_q[:-1][segment_of]
        depth = (path_lens - seg_lens)[segment_of] + offset
        return cls(segment_of, on_path, depth)

    def dense_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """[N, N] bool, True where attention is allowed."""
        n = self.segment_of.numel()
        pos = torch.arange(n, device=self.segment_of.device)
        allowed = self.on_path[self.segment_of] & (pos[None, :] <= pos[:, None])
        if sliding_window:
            allowed &= (self.depth[:, None] - self.depth[None, :]) < sliding_window
        return allowed


class _LayoutCache:
    """Every decoder layer of one forward receives the same tree tensors: build the layout once per forward.

    The cached entry holds the tensors themselves, so their storage cannot be reused while it is cached."""

    def __init__(self):
        self._key, self._tensors, self._value = None, None, None

    def get(self, kv_index, cu_q, cu_k, n: int, build):
        key = tuple((t.data_ptr(), t.numel(), t._version) for t in (kv_index, cu_q, cu_k)) + (n, str(kv_index.device))
        if key != self._key:
            self._key, self._tensors, self._value = key, (kv_index, cu_q, cu_k), build()
        return self._value


_layouts = _LayoutCache()
_masks = _LayoutCache()


def _layout(tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, n: int) -> TreeLayout:
    return _layouts.get(tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, n,
                        lambda: TreeLayout.from_trl(tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, n))


def sdpa_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                        tree_cu_seqlens_k, tree_max_seqlen_q=None, tree_max_seqlen_k=None, scaling=None,
                        sliding_window=None, softcap=None, **kwargs):
    """Tree attention with a dense ancestor mask (transformers' attention-function signature, TRL's tree kwargs)."""
    if softcap:
        raise NotImplementedError("tree_attention='sdpa' has no logit softcap; use 'flex' (CUDA) for this model")
    n = query.shape[2]
    mask = _masks.get(tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, n, lambda: _layout(
        tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, n).dense_mask(sliding_window))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.to(query.dtype), value.to(query.dtype), attn_mask=mask[None, None], scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


_flex_compiled = None


def _flex_attention():
    global _flex_compiled
    if _flex_compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex_compiled = torch.compile(flex_attention, dynamic=True)
    return _flex_compiled


FLEX_BLOCK = 128  # FlexAttention's block size: rows are padded to a multiple of it


def _padded_length(n: int) -> int:
    """Packed rows are padded to a multiple of `FLEX_BLOCK`. A row shorter than 128 tokens (a tiny model's) would
    otherwise compile to FlexAttention's decoding kernel, which found no valid configuration on the H200 for the
    loop's float32 head_dim-32 strided queries; and one compiled graph then serves every row length."""
    return -(-n // FLEX_BLOCK) * FLEX_BLOCK


def _pad_layout(layout: TreeLayout, n_pad: int) -> TreeLayout:
    """Padding queries belong to segment 0 (their outputs are dropped; a non-empty row keeps them finite); padding
    keys lie on no path, so no real query sees them."""
    extra = n_pad - layout.segment_of.numel()
    if extra == 0:
        return layout
    return TreeLayout(*(torch.nn.functional.pad(t, (0, extra)) for t in (layout.segment_of, layout.on_path,
                                                                          layout.depth)))


def _mask_mod(layout: TreeLayout, sliding_window: int | None):
    """The ancestor rule of `TreeLayout.dense_mask` as a FlexAttention `mask_mod`."""
    segment_of, on_path, depth = layout.segment_of, layout.on_path, layout.depth

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = on_path[segment_of[q_idx], kv_idx] & (kv_idx <= q_idx)
        if sliding_window:
            allowed = allowed & ((depth[q_idx] - depth[kv_idx]) < sliding_window)
        return allowed

    return mask_mod


def _block_mask(layout: TreeLayout, n_pad: int, sliding_window: int | None):
    from torch.nn.attention.flex_attention import create_block_mask

    layout = _pad_layout(layout, n_pad)
    return create_block_mask(_mask_mod(layout, sliding_window), B=None, H=None, Q_LEN=n_pad, KV_LEN=n_pad,
                             device=layout.segment_of.device)


_block_masks = _LayoutCache()


def flex_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                        tree_cu_seqlens_k, tree_max_seqlen_q=None, tree_max_seqlen_k=None, scaling=None,
                        sliding_window=None, softcap=None, **kwargs):
    """Tree attention with FlexAttention: only the blocks the trie touches are computed (CUDA)."""
    if query.device.type != "cuda":
        raise RuntimeError("tree_attention='flex' needs a CUDA device (FlexAttention has no CPU backward); "
                           "use tree_attention='sdpa' on a CPU")
    n = query.shape[2]
    n_pad = _padded_length(n)
    block_mask = _block_masks.get(tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, n, lambda: _block_mask(
        _layout(tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, n), n_pad, sliding_window))

    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    def padded(t):
        return torch.nn.functional.pad(t.to(query.dtype), (0, 0, 0, n_pad - n))

    out = _flex_attention()(padded(query), padded(key), padded(value), score_mod=capped if softcap else None,
                            block_mask=block_mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out[:, :, :n].transpose(1, 2).contiguous(), None


IMPLEMENTATIONS = {"sdpa": sdpa_tree_attention, "flex": flex_tree_attention}


def fa3_available() -> bool:
    """TRL's Hub kernel can run here: the `kernels` package, a Hopper GPU, and the Hub (or its cache) reachable."""
    if (importlib.util.find_spec("kernels") is None or not torch.cuda.is_available()
            or torch.cuda.get_device_capability() != (9, 0)):
        return False
    try:
        from trl.experimental.async_grpo.packing import _flash_attn

        _flash_attn()
    except Exception as error:  # offline without a cached kernel, or a kernel/torch mismatch
        log.info("tree attention: the Hub flash-attn3 kernel is not usable here (%s)", error)
        return False
    return True


def resolve(choice: str, device: torch.device | str | None = None) -> str:
    """The implementation `choice` means on `device`: 'auto' picks fa3, then flex on CUDA, then sdpa."""
    if choice not in CHOICES:
        raise ValueError(f"tree_attention must be one of {', '.join(CHOICES)}, got {choice!r}")
    device_type = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available()
                                                                           else "cpu")
    if choice == "auto":
        if device_type == "cuda":
            return "fa3" if not environment.hub_offline() and fa3_available() else "flex"
        return "sdpa"
    if choice == "flex" and device_type != "cuda":
        raise ValueError("tree_attention='flex' needs a CUDA device (FlexAttention has no CPU backward); use 'sdpa'")
    if choice == "fa3" and device_type != "cuda":
        raise ValueError("tree_attention='fa3' needs a Hopper GPU and the Hub kernel; use 'sdpa' on a CPU")
    return choice


def install(model, choice: str) -> str:
    """Make `model` (built by TRL with attn_implementation 'tree_fa3') use implementation `choice`; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    impl = resolve(choice, next(model.parameters()).device)
    if impl == "fa3":
        return impl  # TRL's registration stands
    name = f"grpo_lab_tree_{impl}"
    AttentionInterface.register(name, IMPLEMENTATIONS[impl])
    AttentionMaskInterface.register(name, lambda **kwargs: None)  # the tree kwargs carry the mask
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(name)
    return impl
