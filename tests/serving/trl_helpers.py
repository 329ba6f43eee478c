"""Picklable pieces for TRL's spawned rollout worker: a character tokenizer with a chat template, a reward."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast


class CharTokenizer(PreTrainedTokenizerFast):
    """Plain-text responses (no tool calls): TRL's worker needs a response parser and knows none for this template."""

    def parse_response(self, ids, *args, **kwargs):
        return {"role": "assistant", "content": self.decode(ids, skip_special_tokens=True)}


def char_tokenizer():
    """A tokenizer whose ids fit tiny-qwen3's 512-token vocab (pad 0, bos 1, eos 2), with a ChatML-like template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    for c in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = CharTokenizer(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.response_template = {"type": "plain-text"}  # marks a parser as present; parse_response above is it
    return tok


def length_reward(completions, **kwargs):
    return [float(len(str(c))) for c in completions]
