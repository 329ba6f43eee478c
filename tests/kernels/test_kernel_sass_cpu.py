"""The fused head's kernels as the compiler builds them for Hopper, read on a CPU (`benchmarks/kernel_sass.py`).

Compiling for sm_90a needs no GPU (Triton ships ptxas and nvdisasm), so a change that makes a production kernel spill
registers, or lose its wgmma main loop, fails here rather than only as a slower GPU run (issue 45: the materialised
forward's plain stores spilled 2 KiB per thread before they went through tensor descriptors).
"""

import pytest
from benchmark_scripts import load_benchmark

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def sass():
    return load_benchmark("kernel_sass")


def _compiled(sass, name, **changes):
    from grpo_lab.loss.kernel.tuning import TUNING

    _, kernel, key, constexprs, descriptors = {v[0]: v for v in sass._variants(TUNING)}[name]
    return sass.summarize(*sass.compile_sass(kernel, {**constexprs, **changes}, descriptors, TUNING.configs[key]))


# Spill bytes allowed per thread: the 128 x 256 tiles hold 128 fp32 accumulators a thread, and the compiler may
# spill a few words there (Triton 3.6: frozen and kept probabilities 72 B, statistics 0 B; 3.9: up to 136 B). Before
# issue 45's changes they spilled 360 B (statistics) and 2024 B (kept probabilities) under Triton 3.6, and the frozen
# forward's old epilogue did not fit this tile at all.
SPILL_BYTES = {"frozen": 160, "stats": 160, "kept": 160}


@pytest.mark.parametrize("name", sorted(SPILL_BYTES))
def test_the_forwards_compile_to_wgmma_with_at_most_a_few_spilled_words(sass, name):
    s = _compiled(sass, name)
    assert s["ops"]["HGMMA"] > 0, s  # the wgmma main loop, not a fallback to mma.sync
    assert s["stack"] <= SPILL_BYTES[name], s


def test_the_leaner_epilogue_is_smaller_than_the_old_one(sass):
    """The frozen forward with the per-element target search and zeroing, and tl.exp's denormal rescale, back on
    (what the epilogue was): the production kernel must stay well under it."""
    lean = _compiled(sass, "frozen")
    old = _compiled(sass, "frozen", ZERO_TARGET=True, TZ_FROM_REF=False, FAST_EXP=False, EVEN_N=False)
    assert lean["instructions"] < 0.6 * old["instructions"], (lean["instructions"], old["instructions"])
    assert lean["ops"]["MUFU"] < old["ops"]["MUFU"]


def test_the_script_prints_one_line_per_kernel_and_refuses_unknown_ones(sass, capsys):
    assert sass.main(["--kernels", "frozen", "--ops", "3"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("frozen") and "registers" in line and "HGMMA" in line
    with pytest.raises(SystemExit) as err:
        sass.main(["--kernels", "nope"])
    assert err.value.code == 2
    assert "unknown kernels" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:  # a misspelt constexpr is an error, not silently ignored
        sass.main(["--kernels", "frozen", "--set", "ZERO_TARGETS=True"])
    assert err.value.code == 2
    assert "no kernel has" in capsys.readouterr().err
