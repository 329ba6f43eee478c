"""Fixtures of the core tests; the helpers live in `trainer_fixtures`."""

import pytest
import torch

from grpo_lab.tasks.tiny import build_char_tokenizer
from trainer_fixtures import make_trainer


@pytest.fixture
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def trainer_factory(tmp_path, tokenizer):
    def factory(**config):
        return make_trainer(tmp_path, tokenizer, **config)

    torch.manual_seed(0)
    return factory
