"""The embedded chat model: one small, trained model that the trainer, the CPU replica and real vLLM all serve.

The async loop needs a model *directory* (TRL's `AsyncGRPOTrainer` and vLLM load by path), a tokenizer with a chat
template TRL can parse responses of, and weights that are not near-uniform (a random-init model samples the same
tokens whatever adapter serves it, so a wrong-adapter bug would be invisible). Offline, that is:

- the tiny Qwen2 of `grpo_lab.tasks.tiny` (head_dim 32: vLLM's CPU attention needs >= 32), SFT'd on 2-digit addition
  in chat form to about 40 % right (`data/mini/`), saved as the equivalent Llama (`as_llama`);
- a character tokenizer with the ChatML specials and Qwen3's chat template, which TRL's response parser recognises:
  `<|im_start|>user\\n12+34=<|im_end|>\\n<|im_start|>assistant\\n` (25 tokens), answered `\\boxed{46}<|im_end|>`.

    path = write_embedded_model("/tmp/tiny-chat")     # or embedded_model_dir(): a shared cached copy
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from grpo_lab.lab import environment

EMBEDDED_MODEL_NAME = "grpo-lab/tiny-addition-chat"
WARM_START_FILE = "tiny_addition_chat_sft.safetensors"
IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIALS = [PAD, IM_START, IM_END, "<unk>"]
CHARS = list("0123456789+-*=?}{. \n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
MAX_POSITIONS = 128  # RoPE: a config number, not weights, so it can exceed what SFT saw


def build_chat_tokenizer():
    """A fast tokenizer: ChatML specials, `\\boxed{` as one token, one token per other character, and
    Qwen3's chat template as TRL ships it (so TRL's response parser knows it)."""
    from trl.chat_template_utils import qwen3_chat_template

    from grpo_lab.tasks.tiny import char_tokenizer

    fast = char_tokenizer(SPECIALS, CHARS, pad_token=PAD, eos_token=IM_END, additional_special_tokens=[IM_START])
    fast.chat_template = qwen3_chat_template
    return fast


def render_prompt(tokenizer, problem: str) -> str:
    """The chat prompt of one problem as text (what the rollout worker tokenizes)."""
    return tokenizer.apply_chat_template(chat_messages(problem), tokenize=False, add_generation_prompt=True)


def chat_messages(problem: str) -> list[dict[str, str]]:
    """The conversational prompt TRL's async trainer expects in its dataset's `prompt` column."""
    return [{"role": "user", "content": problem}]


def build_chat_model(tokenizer, seed: int = 0):
    from grpo_lab.tasks.tiny import TinyModelConfig, build_tiny_model

    return build_tiny_model(tokenizer, TinyModelConfig(max_position_embeddings=MAX_POSITIONS), seed=seed)


def as_llama(model):
    """The same network as a `LlamaForCausalLM` (q/k/v biases, a zero o_proj bias): exactly the same function.

    Why: transformers maps the `qwen2` model type to its own Qwen2 tokenizer class, which rebuilds the pre-tokenizer
    of any tokenizer saved beside it (the character tokenizer would lose its newlines); for `llama` the saved
    tokenizer class is used as is, by transformers and by vLLM alike."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "hidden_act", "pad_token_id",
            "eos_token_id", "bos_token_id")
    llama = LlamaForCausalLM(LlamaConfig(
        **{k: getattr(c, k) for k in same}, head_dim=c.hidden_size // c.num_attention_heads,
        rope_parameters=dict(c.rope_parameters), tie_word_embeddings=True, attention_bias=True, mlp_bias=False))
    state = dict(model.state_dict())
    for name, param in llama.state_dict().items():
        if name.endswith("o_proj.bias"):
            state[name] = torch.zeros_like(param)
    llama.load_state_dict(state, strict=True)
    llama.generation_config = model.generation_config
    return llama


def load_embedded_model(warm_start: str | os.PathLike | None = None):
    """(model, tokenizer) with the shipped (or given) SFT weights, in float32, on the CPU."""
    from grpo_lab.tasks.sft import load_warm_start, shipped_warm_start

    tokenizer = build_chat_tokenizer()
    model = build_chat_model(tokenizer)
    path = Path(warm_start) if warm_start is not None else shipped_warm_start(WARM_START_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"no warm start at {path}; regenerate it with `python -m grpo_lab.tasks.embedded_model "
                                f"--train --out {path}`")
    load_warm_start(model, path)
    return as_llama(model).eval(), tokenizer


def write_embedded_model(directory: str | os.PathLike, warm_start: str | os.PathLike | None = None) -> Path:
    """Save the embedded model and tokenizer as a transformers directory (what TRL, the CPU replica and vLLM load).

    Written beside the target and renamed into place, so a reader never sees a half-written directory."""
    target = Path(directory)
    model, tokenizer = load_embedded_model(warm_start)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.config.name_or_path = EMBEDDED_MODEL_NAME
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _fingerprint() -> str:
    """Changes whenever the shipped weights or this module's layout change, so a stale cached copy is not reused."""
    from grpo_lab.tasks.sft import shipped_warm_start
    from grpo_lab.tasks.tiny import BOX

    h = hashlib.sha256(shipped_warm_start(WARM_START_FILE).read_bytes())
    h.update(json.dumps([SPECIALS, BOX, CHARS, MAX_POSITIONS, "llama"]).encode())
    return h.hexdigest()[:12]


def embedded_model_dir() -> Path:
    """A shared, cached copy of the embedded model (written once per weights version)."""
    target = environment.cache_dir() / "models" / f"tiny-addition-chat-{_fingerprint()}"
    if not (target / "config.json").is_file():
        write_embedded_model(target)
    return target


def train_warm_start(out: str | os.PathLike, seed: int = 0, target_pass_rate: float = 0.4, lr: float = 3e-3,
                     log=print) -> dict:
    """Regenerate the shipped SFT weights: the tiny model SFT'd on chat-rendered addition problems."""
    from grpo_lab.tasks.sft import save_warm_start, sft_warm_start
    from grpo_lab.tasks.tiny import addition_problems

    tokenizer = build_chat_tokenizer()
    model = build_chat_model(tokenizer, seed=seed)
    train_pool, _ = addition_problems(seed=seed)
    rows = [dict(r, problem=render_prompt(tokenizer, r["problem"])) for r in train_pool]
    info = sft_warm_start(model, tokenizer, rows, target_pass_rate=target_pass_rate, lr=lr, seed=seed,
                          log=log)
    save_warm_start(model, out, seed=seed, steps=info["steps"], pass_rate=f"{info['pass_rate']:.4f}", lr=lr,
                    format="chat")
    return info


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m grpo_lab.tasks.embedded_model", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="with --train: the .safetensors to write; else a directory")
    p.add_argument("--train", action="store_true", help="retrain the SFT warm start instead of writing the model")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.train:
        info = train_warm_start(a.out, seed=a.seed)
        print({k: v for k, v in info.items() if k != "history"})
    else:
        print(write_embedded_model(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
