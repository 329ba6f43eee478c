"""No deprecation noise in the notebooks: the kit passes transformers' current argument names, and silences only the
deprecation TRL 1.16 raises from its own code."""

import warnings

import pytest

from grpo_lab.models.hf_compat import checkpointing_args, upstream_deprecations_silenced


@pytest.mark.parametrize("enabled", [False, True])
def test_trainer_config_without_deprecation_warnings(tmp_path, enabled):
    from grpo_lab.loss import GRPOLabConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = GRPOLabConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                             **checkpointing_args(enabled))
    assert args.gradient_checkpointing is enabled
    assert not [w for w in caught if "deprecated" in str(w.message)], [str(w.message) for w in caught]


def test_only_the_named_upstream_deprecation_is_silenced():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upstream_deprecations_silenced():
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
            warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]
