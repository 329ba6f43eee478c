"""`relaunch.Relauncher`: which launches go through Triton's JIT and which straight to the compiled kernel, and with
what arguments. A stand-in kernel records the calls; the GPU tests run the real kernels through it."""

import pytest

pytest.importorskip("triton", reason="Triton is a dependency on Linux only")

import torch  # noqa: E402

from grpo_lab.loss.kernel import relaunch  # noqa: E402
from grpo_lab.loss.kernel.tuning import TUNING  # noqa: E402


class Compiled:
    function = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class Kernel:
    """A JITFunction's surface: `arg_names`, and `kernel[grid](**kwargs)` returning what it compiled."""

    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self, returns_compiled=True):
        self.log = []
        self.returns_compiled = returns_compiled

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.log.append(("jit", grid, kwargs))
            return Compiled(self.log) if self.returns_compiled else None
        return launch


def test_the_first_launch_of_a_key_compiles_the_rest_go_direct_in_argument_order(monkeypatch):
    monkeypatch.setattr(TUNING, "direct_launch", True)
    kernel, x = Kernel(), torch.zeros(4)
    launcher = relaunch.Relauncher(kernel)
    for n in (32, 64, 48):
        launcher((5,), lambda: (relaunch.int_spec(n),), {"BLOCK": 16, "n": n, "x_ptr": x}, {"num_warps": 4})
    launcher((7,), lambda: (relaunch.int_spec(3),), {"BLOCK": 16, "n": 3, "x_ptr": x}, {"num_warps": 4})
    kinds = [(kind, grid) for kind, grid, _ in kernel.log]
    # 32, 64 and 48 are all divisible by 16 (one key); 3 is not: Triton's JIT again, for its own specialisation
    assert kinds == [("jit", (5,)), ("direct", (5, 1, 1)), ("direct", (5, 1, 1)), ("jit", (7,))]
    assert kernel.log[0][2] == {"BLOCK": 16, "n": 32, "x_ptr": x, "num_warps": 4}
    assert kernel.log[1][2] == (x, 64, 16) and kernel.log[2][2] == (x, 48, 16)


@pytest.mark.parametrize("direct_launch,returns_compiled", [(False, True), (True, False)])
def test_every_launch_goes_through_the_jit_when_off_or_under_the_interpreter(monkeypatch, direct_launch,
                                                                             returns_compiled):
    monkeypatch.setattr(TUNING, "direct_launch", direct_launch)
    kernel = Kernel(returns_compiled)  # Triton's interpreter compiles nothing and returns None
    launcher, keyed = relaunch.Relauncher(kernel), []
    for n in (16, 32):
        launcher((2,), lambda: keyed.append(n) or (relaunch.int_spec(n),), {"BLOCK": 16, "n": n, "x_ptr": None}, {})
    assert [kind for kind, _, _ in kernel.log] == ["jit", "jit"]
    assert keyed == ([16, 32] if direct_launch else [])  # off, the key is never built: the default path pays nothing


def test_specs_separate_what_triton_specialises_on():
    spec = relaunch.int_spec
    assert spec(1) != spec(17) and spec(16) == spec(4096) != spec(4100) and spec(2**31) != spec(2**31 - 16)
    buf = torch.zeros(64)
    assert relaunch.arg_spec(buf[4:]) == relaunch.arg_spec(buf[8:]) != relaunch.arg_spec(buf[1:])
    assert relaunch.arg_spec(buf) != relaunch.arg_spec(buf.double())

