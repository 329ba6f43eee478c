r"""The embedded default's task and model: 2-digit addition, a character tokenizer, a ~0.6M-parameter Qwen2.

Problems are `"ab+cd="` (fixed length: batches need no padding), answered `\boxed{n}` with `\boxed{` one token, so
the recipe's math reward grades them; the pairs are split once into a training and a held-out pool.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

BOX = "\\boxed{"
SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*=?}. ")


def char_tokenizer(specials: list[str], chars: list[str], **named) -> PreTrainedTokenizerFast:
    """A fast HF tokenizer TRL can use: `specials`, then `\\boxed{` as one token, then one token per character of
    `chars`; `named` names its special tokens (`pad_token`, `eos_token`, ...)."""
    vocab = {t: i for i, t in enumerate(specials + [BOX] + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\\boxed\{|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", padding_side="left",
                                   truncation_side="left", **named)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny task's character tokenizer."""
    return char_tokenizer(SPECIALS, CHARS, pad_token="<pad>", eos_token="<eos>")


@dataclass
class TinyModelConfig:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 64


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, cfg: TinyModelConfig | None = None, seed: int = 0):
    """A random-init Qwen2-architecture causal LM sized for the character vocabulary (the tokenizer's eos and pad
    reach its generation config through the model config)."""
    cfg = cfg or TinyModelConfig()
    config = Qwen2Config(vocab_size=len(tokenizer), **asdict(cfg), tie_word_embeddings=True, use_cache=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)  # TinyModelConfig's fields are Qwen2Config's
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def addition_problems(seed: int = 0, lo: int = 10, hi: int = 99, heldout_frac: float = 0.2):
    """All pairs a+b with lo<=a,b<=hi, shuffled by `seed` and split into (train_pool, heldout_pool)."""
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    random.Random(seed).shuffle(pairs)
    n_held = int(len(pairs) * heldout_frac)
    to_rows = lambda ps: [{"problem": f"{a}+{b}=", "answer": str(a + b)} for a, b in ps]  # noqa: E731
    return to_rows(pairs[n_held:]), to_rows(pairs[:n_held])


def completion_for(answer: str) -> str:
    return f"{BOX}{answer}}}"
