"""Compile the fused head's Triton kernels for Hopper (sm_90a) on any machine, GPU or not, and print what the
compiler made of them: registers, spill bytes, and the instruction count and mix of the machine code (SASS).

Why: a GPU is scarce and an epilogue instruction saved is time saved in every tile, so the cheap loop is to change a
kernel, read its SASS here, and take only the promising versions to a GPU (issue 45: the frozen forward went from
4264 to 1728 instructions this way before it was timed). Triton compiles ahead of time for a named target and ships
`ptxas`, `cuobjdump` and `nvdisasm`; nothing runs.

    python benchmarks/kernel_sass.py                       # the production configurations
    python benchmarks/kernel_sass.py --set ZERO_TARGET=True  # a constexpr changed (every kernel that has it)
    python benchmarks/kernel_sass.py --kernels frozen --ops 40 --dump /tmp/frozen.sass
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# The argument types of the kernels' non-constexpr parameters, by name (pointers to the compute dtype unless named).
_POINTER_TYPES = {"tgt_ptr": "*i64", "y_ptr": "*i64", "part_ptr": "*fp32", "tlogit_ptr": "*fp32", "ref_ptr": "*fp32",
                  "logz_ptr": "*fp32", "ent_ptr": "*fp32", "g_ptr": "*fp32", "ge_ptr": "*fp32", "run_ptr": "*fp32",
                  "acc_ptr": "*fp32", "m_ptr": "*fp32", "s_ptr": "*fp32", "lp_ptr": "*fp32", "omp_ptr": "*fp32",
                  "shift_ptr": "*fp32", "bad_ptr": "*i8", "count_ptr": "*i32", "c_ptr": "*fp32"}
_FLOATS = ("logit_scale", "softcap", "inv_t", "limit", "excess", "scale", "inv_cap")


def _variants(tuning):  # (getattr: the settings an older checkout lacks, so that its kernels compile here too)
    """(name, kernel, tile config key, {constexpr: value}, {descriptor arg: block shape}) of each production launch:
    the frozen head's forward, the statistics-only forward, the materialised head's forward (`kept`: stores its
    [N, V] probabilities) and the recomputing backward, bf16, TMA loads on."""
    from grpo_lab.loss.kernel import triton_kernels as tk

    common = dict(HAS_BIAS=False, HAS_SOFTCAP=False, PRECISION="tf32", EVEN_K=True, USE_TMA=True, PERSISTENT=True,
                  NUM_PROGRAMS=132, FAST_EXP=getattr(tuning, "fast_exp", False))
    fwd = dict(common, HAS_ENTROPY=True, HAS_SQ=False, HAS_MEAN=False, HAS_TOP1=False, STORE_PZ=False, EVEN_N=True,
               ZERO_TARGET=not getattr(tuning, "target_zero_pass", False), REF_STATS=False)
    frozen = dict(fwd, P_MODE=1, P_TMA=tuning.p_tma["16"], TZ_FROM_REF=getattr(tuning, "target_logit_from_ref", False))
    stats = dict(fwd, P_MODE=0, P_TMA=False, TZ_FROM_REF=getattr(tuning, "target_logit_from_ref", False))
    deferred = getattr(tuning, "materialized_deferred_check", {}).get("16", False)  # statistics against block maxima
    kept = dict(fwd, P_MODE=2, P_TMA=tuning.p_tma["16"], TZ_FROM_REF=getattr(tuning, "target_logit_from_ref", False),
                REF_STATS=tuning.ref_stats["16"] and not deferred)
    bwd = dict(common, HAS_G=True, HAS_GE=False, DZ_TMA=tuning.dz_tma["16"])
    return [("frozen", tk.fwd_kernel, "frozen_16", frozen, {"p_ptr": "BMxBN", "pz_ptr": "BMxBN"}),
            ("stats", tk.fwd_kernel, "fwd_16", stats, {}),
            ("kept", tk.fwd_kernel, "fwd_16", kept, {"p_ptr": "BMxBN", "pz_ptr": "BMxBN"}),
            ("bwd", tk.bwd_kernel, "bwd_16", bwd, {"dz_ptr": "BMxBN"})]


def _signature(kernel, constexprs, descriptors, bm, bn, bk):
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "h_ptr" and constexprs.get("USE_TMA"):
            sig[name] = f"tensordesc<bf16[{bm},{bk}]>"
        elif name == "w_ptr" and constexprs.get("USE_TMA"):
            sig[name] = f"tensordesc<bf16[{bn},{bk}]>"
        elif name.endswith("_desc"):  # a descriptor argument of its own: `descriptors` gives its element type and block
            sig[name] = f"tensordesc<{descriptors[name]}>"
        elif name in descriptors and constexprs.get({"dz_ptr": "DZ_TMA"}.get(name, "P_TMA")):
            sig[name] = f"tensordesc<bf16[{bm},{bn}]>"
        elif name.endswith("_ptr"):
            sig[name] = _POINTER_TYPES.get(name, "*bf16")
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_kernel(kernel, constexprs, descriptors, config, capability=90):
    """`kernel` compiled for `capability` (Triton's CompiledKernel; no GPU needed) with a tile `config` (BM, BN, BK,
    GROUP_M, warps, stages: those the kernel takes), bf16 compute."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bm, bn, bk, group_m, warps, stages = config
    constexprs = dict(constexprs, BM=bm, BN=bn, BK=bk, GROUP_M=group_m, COMPUTE=tl.bfloat16)
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=_signature(kernel, constexprs, descriptors, bm, bn, bk), constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def compile_sass(kernel, constexprs, descriptors, config, capability=90):
    """(cubin bytes, SASS text) of `kernel` compiled for `capability` with a tile `config` (`compile_kernel`)."""
    cubin = compile_kernel(kernel, constexprs, descriptors, config, capability).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return sass, usage


_OP = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def summarize(sass: str, usage: str) -> dict:
    """Registers, spill (stack) bytes, instruction count and per-opcode counts of one kernel."""
    ops = collections.Counter(m.group(1) for line in sass.splitlines() if (m := _OP.match(line)))
    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    return {"regs": field.get("REG", 0), "stack": field.get("STACK", 0), "instructions": sum(ops.values()),
            "ops": ops}


def _value(text: str):
    return {"True": True, "False": False}.get(text, int(text) if text.lstrip("-").isdigit() else text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default="frozen,stats,kept,bwd", help="of frozen, stats, kept, bwd (default: all)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a constexpr for every kernel that has it (repeatable), e.g. ZERO_TARGET=True")
    p.add_argument("--ops", type=int, default=12, help="most frequent opcodes to list (default: %(default)s)")
    p.add_argument("--dump", default="", help="write the SASS of the (last) kernel here")
    args = p.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        p.error("Triton is not installed: pip install triton")
    changes = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name:
            p.error(f"--set {item!r}: NAME=VALUE")
        changes[name] = _value(value)
    from grpo_lab.loss.kernel.tuning import TUNING

    variants = {v[0]: v for v in _variants(TUNING)}
    wanted = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in variants]
    if unknown:
        p.error(f"unknown kernels {unknown}: choose from {', '.join(variants)}")
    known = {arg for v in variants.values() for arg in v[1].arg_names}
    if set(changes) - known:
        p.error(f"--set: no kernel has {sorted(set(changes) - known)}")
    for name in wanted:
        _, kernel, key, constexprs, descriptors = variants[name]
        constexprs = {**constexprs, **{k: v for k, v in changes.items() if k in kernel.arg_names}}
        sass, usage = compile_sass(kernel, constexprs, descriptors, TUNING.configs[key])
        s = summarize(sass, usage)
        mix = ", ".join(f"{op} {n}" for op, n in s["ops"].most_common(args.ops))
        print(f"{name:7s} {'x'.join(map(str, TUNING.configs[key]))}: {s['regs']} registers, {s['stack']} B spilled, "
              f"{s['instructions']} instructions, {s['ops']['HGMMA']} HGMMA | {mix}", flush=True)
        if args.dump:
            with open(args.dump, "w") as f:
                f.write(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
