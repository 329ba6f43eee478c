"""Runs the frozen head's row kernels in Triton's CPU interpreter against their torch statement and prints the
largest differences as JSON (a separate process: `TRITON_INTERPRET=1` must be set before the kernels are decorated).

`frozen_finish_kernel` against `launch._bad_rows` + `launch._rebase_to_log_z` (rows that overflow, are not finite,
or, with B, exceed `plogp_excess`), `ref_logit_kernel` against the target logit computed in float64, and
`frozen_dx_kernel` against `frozen.frozen_input_grad`, with and without B, softcap and an entropy gradient.
"""

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from grpo_lab.loss.frozen import frozen_input_grad  # noqa: E402
from grpo_lab.loss.kernel import launch  # noqa: E402
from grpo_lab.loss.kernel.triton_kernels import frozen_dx_kernel, frozen_finish_kernel, ref_logit_kernel  # noqa: E402


def main() -> dict:
    gen = torch.Generator().manual_seed(3)
    n, k, v = 37, 300, 50
    out = {}
    for depth in (1, 2):
        acc = torch.randn(depth, n, k, generator=gen)
        run_m = torch.randn(n, generator=gen) * 3
        ref = run_m - torch.rand(n, generator=gen) * 4
        run_s = 1 + torch.rand(n, generator=gen) * 10
        ref[3] = run_m[3] - 70  # over the headroom
        acc[0, 5, 7] = float("inf")  # not finite
        acc[-1, 9, 0] = float("nan")
        run_s[11] = 1.01  # peaked: p_max·(max − ref) over plogp_excess when B is there
        ref[11] = run_m[11] - 3.5
        expect_bad = launch._bad_rows(run_m, run_s, ref, acc, torch.bfloat16, 60.0)
        expect_acc = launch._rebase_to_log_z(acc.clone(), run_m, run_s, ref)
        got_acc = acc.clone()
        bad = torch.empty(n, dtype=torch.int8)
        count = torch.zeros(1, dtype=torch.int32)
        frozen_finish_kernel[(3,)](got_acc, run_m, run_s, ref, bad, count, n, k, got_acc.stride(0), 60.0, 2.0,
                                   HAS_B=depth == 2, BR=16, BH=128)
        good = ~expect_bad
        out[f"finish_bad_agree_{depth}"] = bool((bad.bool() == expect_bad).all())
        out[f"finish_count_{depth}"] = [int(count), int(expect_bad.sum())]
        out[f"finish_bad_rows_{depth}"] = expect_bad.nonzero().squeeze(-1).tolist()
        out[f"finish_acc_{depth}"] = (got_acc[:, good] - expect_acc[:, good]).abs().max().item()
    hidden = torch.randn(n, k, generator=gen)
    weight = torch.randn(v, k, generator=gen) * 0.1
    bias = torch.randn(v, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    for softcap in (None, 5.0):
        z = torch.empty(n)
        ref_logit_kernel[(3,)](hidden, weight, bias, y, z, n, k, hidden.stride(0), weight.stride(0), 1.3,
                               softcap or 1.0, 1 / 0.9, HAS_BIAS=True, HAS_SOFTCAP=softcap is not None,
                               COMPUTE=launch.TL_DTYPE[torch.float32], BR=16, BH=128)
        expect = ((hidden.double() * weight.double()[y]).sum(-1) + bias.double()[y]) * 1.3
        if softcap is not None:
            expect = softcap * torch.tanh(expect / softcap)
        out[f"ref_logit_{softcap}"] = (z.double() - expect / 0.9).abs().max().item()
    for depth, softcap, with_g, with_ge in ((1, None, True, False), (2, 5.0, True, True), (2, None, False, True)):
        acc = torch.randn(depth, n, k, generator=gen)
        lp = -torch.rand(n, generator=gen) * 3
        ent = torch.rand(n, generator=gen) * 4
        tlogit = torch.randn(n, generator=gen) * 2
        g = torch.randn(n, generator=gen) if with_g else None
        ge = torch.randn(n, generator=gen) if with_ge else None
        inv_t, scale = 1 / 0.9, 1.3
        c_target = torch.ones(n) if softcap is None else 1 - (tlogit / (softcap * inv_t)) ** 2
        expect = frozen_input_grad(acc[0], acc[1] if depth == 2 else None, lambda r0, r1: weight[y[r0:r1]], g, ge, lp,
                                   ent, c_target, inv_t * scale, torch.empty(n, k))
        got = torch.empty(n, k)
        omp = -torch.expm1(lp)
        frozen_dx_kernel[(2, 3)](acc, weight, y, g if g is not None else omp, ge if ge is not None else omp, lp, omp,
                                 ent, tlogit, got, n, k, acc.stride(0), weight.stride(0), got.stride(0),
                                 inv_t * scale, 1 / (softcap * inv_t) if softcap else 1.0, HAS_G=g is not None,
                                 HAS_GE=ge is not None, HAS_B=depth == 2, HAS_SOFTCAP=softcap is not None,
                                 COMPUTE=launch.TL_DTYPE[torch.float32], BR=32, BH=128)
        out[f"dx_{depth}_{softcap}_{with_g}_{with_ge}"] = ((got - expect).norm() / expect.norm()).item()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
