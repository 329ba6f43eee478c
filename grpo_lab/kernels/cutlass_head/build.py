"""Compile the CUTLASS frozen-head forward once per machine and load it with ctypes.

Triton 3.6 cannot overlap this kernel's softmax epilogue with its tensor-core work; CUTLASS's warp-specialised
Hopper GEMM can, and its epilogue visitor tree expresses e^(z − ref) and the row sums. The kernel is C++ templates,
so it is built here (nvcc + CUTLASS headers, ~1 min) rather than shipped as a binary; without the toolchain the
frozen head keeps the Triton path. `python -m grpo_lab.kernels.cutlass_head.build` builds it ahead of a run.

Where things come from, first hit wins:
- nvcc: `GRPO_LAB_NVCC`, `$CUDA_HOME/bin/nvcc`, `nvcc` on PATH, PyPI's `nvidia-cuda-nvcc`;
- CUTLASS headers: `CUTLASS_PATH/include`, PyPI's `nvidia-cutlass` (its `cutlass_library/source/include`);
- a built library: `GRPO_LAB_CUTLASS_LIB_DIR` (prebuilt, read-only), then the cache `GRPO_LAB_CUTLASS_CACHE`
  (default `~/.cache/grpo-lab/cutlass`).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("frozen_forward.cu")


@dataclass(frozen=True)
class Variant:
    """One compiled configuration of the kernel: CTA tile (M, N, K), cluster (M, N) and mainloop schedule."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    cluster_m: int = 1
    cluster_n: int = 2
    pingpong: bool = True
    dag: bool = False  # the epilogue as a graph with shared nodes (one exp per element) instead of a tree
    epilogue_tile: tuple[int, int] | None = None  # None: CUTLASS's automatic choice

    @property
    def name(self) -> str:
        kind = "pingpong" if self.pingpong else "coop"
        extra = ("_dag" if self.dag else "") + (f"_e{self.epilogue_tile[0]}x{self.epilogue_tile[1]}"
                                                if self.epilogue_tile else "")
        return f"{kind}_{self.tile_m}x{self.tile_n}x{self.tile_k}_c{self.cluster_m}x{self.cluster_n}{extra}"

    def defines(self) -> list[str]:
        epi_m, epi_n = self.epilogue_tile or (0, 0)
        return [f"-DTILE_M={self.tile_m}", f"-DTILE_N={self.tile_n}", f"-DTILE_K={self.tile_k}",
                f"-DCLUSTER_M={self.cluster_m}", f"-DCLUSTER_N={self.cluster_n}", f"-DPINGPONG={int(self.pingpong)}",
                f"-DDAG={int(self.dag)}", f"-DEPI_M={epi_m}", f"-DEPI_N={epi_n}"]


VARIANTS = {v.name: v for v in (
    Variant(),
    Variant(tile_n=256, pingpong=False),
    Variant(tile_m=64, tile_n=256),
    Variant(cluster_m=2, cluster_n=1),
    Variant(cluster_m=2, cluster_n=1, dag=True),
    Variant(cluster_m=2, cluster_n=1, dag=True, epilogue_tile=(64, 64)),
    Variant(tile_n=256, cluster_m=2, cluster_n=1, pingpong=False, dag=True),
)}
DEFAULT_VARIANT = Variant().name


class ToolchainMissing(RuntimeError):
    """nvcc or the CUTLASS headers are not on this machine."""


def _pip_package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("GRPO_LAB_NVCC"),
                      os.environ.get("CUDA_HOME") and str(Path(os.environ["CUDA_HOME"], "bin", "nvcc")),
                      shutil.which("nvcc")):
        if candidate and Path(candidate).is_file():
            return candidate
    nvidia = _pip_package_dir("nvidia")
    if nvidia is not None:
        for found in sorted(nvidia.glob("cu*/bin/nvcc")) + sorted(nvidia.glob("cuda_nvcc/bin/nvcc")):
            return str(found)
    return None


def find_cutlass_include() -> Path | None:
    if os.environ.get("CUTLASS_PATH"):
        path = Path(os.environ["CUTLASS_PATH"], "include")
        return path if (path / "cutlass" / "cutlass.h").is_file() else None
    lib = _pip_package_dir("cutlass_library")
    if lib is not None and (lib / "source" / "include" / "cutlass" / "cutlass.h").is_file():
        return lib / "source" / "include"
    return None


def _flags(variant: Variant, cutlass_include: Path, nvcc: str) -> list[str]:
    cuda_root = Path(nvcc).resolve().parent.parent
    return ["-std=c++17", "-O3", "-arch=sm_90a", "--expt-relaxed-constexpr", "-DNDEBUG", *variant.defines(),
            f"-I{cutlass_include}", f"-I{cuda_root / 'include'}", f"-L{cuda_root / 'lib'}", f"-L{cuda_root / 'lib64'}",
            "-Xcompiler", "-fPIC", "-shared"]


def library_name(variant: Variant) -> str:
    """File name of a variant's library: the source's and the variant's hash, so an edit never loads a stale one."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(variant.defines()).encode()).hexdigest()[:12]
    return f"frozen_{variant.name}_{digest}.so"


def cache_dir() -> Path:
    return Path(os.environ.get("GRPO_LAB_CUTLASS_CACHE", Path.home() / ".cache" / "grpo-lab" / "cutlass"))


def build(variant: Variant, out_dir: Path | None = None, quiet: bool = False) -> Path:
    """Compile `variant` into `out_dir` (the cache by default) unless it is there; one build at a time (file lock)."""
    nvcc, include = find_nvcc(), find_cutlass_include()
    if nvcc is None or include is None:
        missing = [name for name, found in (("nvcc", nvcc), ("CUTLASS headers", include)) if found is None]
        raise ToolchainMissing(f"cannot build the CUTLASS frozen-head kernel: {' and '.join(missing)} not found "
                               "(pip install nvidia-cutlass nvidia-cuda-nvcc, or set CUDA_HOME / CUTLASS_PATH)")
    out_dir = Path(out_dir or cache_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / library_name(variant)
    with open(out_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        if not quiet:
            print(f"grpo-lab: building the CUTLASS frozen-head kernel {variant.name} (once per machine, ~1 min)",
                  file=sys.stderr, flush=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        t0 = time.perf_counter()
        done = subprocess.run([nvcc, *_flags(variant, include, nvcc), "-o", str(partial), str(SOURCE)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"nvcc failed on {SOURCE.name} ({variant.name}):\n{done.stderr[-4000:]}")
        partial.rename(target)
        if not quiet:
            print(f"grpo-lab: built {target.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return target


_LOADED: dict[str, ctypes.CDLL] = {}


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    lib.grpo_frozen_forward.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i64, i64, i64, f32, ptr, ptr]
    lib.grpo_frozen_forward.restype = i32
    lib.grpo_frozen_workspace_size.argtypes = [i32, i32, i32]
    lib.grpo_frozen_workspace_size.restype = ctypes.c_size_t
    lib.grpo_frozen_tile_m.restype = i32
    lib.grpo_frozen_tile_n.restype = i32
    return lib


def load(variant: Variant, allow_build: bool = True) -> ctypes.CDLL:
    """The variant's library: prebuilt (`GRPO_LAB_CUTLASS_LIB_DIR`), cached, or built now when `allow_build`."""
    name = library_name(variant)
    if name in _LOADED:
        return _LOADED[name]
    prebuilt = os.environ.get("GRPO_LAB_CUTLASS_LIB_DIR")
    path = Path(prebuilt, name) if prebuilt and Path(prebuilt, name).is_file() else cache_dir() / name
    if not path.is_file():
        if not allow_build:
            raise ToolchainMissing(f"{name} is not built (python -m grpo_lab.kernels.cutlass_head.build)")
        path = build(variant)
    _LOADED[name] = _bind(ctypes.CDLL(str(path)))
    return _LOADED[name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANT,
                        help=f"comma-separated, or 'all' ({', '.join(VARIANTS)})")
    parser.add_argument("--out-dir", type=Path, default=None, help="where the libraries go (default: the cache)")
    args = parser.parse_args(argv)
    names = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    try:
        for name in names:
            print(build(VARIANTS[name], args.out_dir))
    except (ToolchainMissing, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
