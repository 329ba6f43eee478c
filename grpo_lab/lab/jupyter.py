"""`grpo-lab lab`: open the notebooks in JupyterLab on this environment, bound to loopback.

    grpo-lab lab                          # JupyterLab at http://127.0.0.1:8888/lab/tree/notebooks (token in the URL)
    grpo-lab lab --port 8899 --no-browser
    grpo-lab lab -- --ServerApp.token=...   # anything after `--` goes to `jupyter lab` as it is

The server runs on this Python, so its `python3` kernel is this environment's; it listens on 127.0.0.1 only and
replaces this process (same PID: Ctrl-C or a test's kill stops it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from .install import install_hint
from .outputs import repo_root

LOOPBACK = "127.0.0.1"


def lab_command(root: str | os.PathLike | None = None, port: int = 8888, open_browser: bool = True,
                extra: list[str] | None = None) -> list[str]:
    """The `python -m jupyterlab ...` command line: loopback, the given root (default: the checkout, else the
    current folder), opening on its notebooks/ folder when there is one."""
    root = Path(root).resolve() if root else (repo_root() or Path.cwd())
    if not root.is_dir():
        raise ValueError(f"no folder {root}")
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.ip={LOOPBACK}", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}"]
    if (root / "notebooks").is_dir():
        cmd.append("--LabApp.default_url=/lab/tree/notebooks")
    if not open_browser:
        cmd.append("--ServerApp.open_browser=False")
    if hasattr(os, "geteuid") and os.geteuid() == 0:   # containers, Colab-like VMs: Jupyter refuses root otherwise
        cmd.append("--ServerApp.allow_root=True")
    return cmd + list(extra or [])


def kernel_mismatch() -> str | None:
    """A warning when the `python3` kernel JupyterLab will start is not this Python (a user-level kernelspec of
    that name shadows the environment's own), else None."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel  # JupyterLab's, which main checked

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        return None
    exe = spec.argv[0] if spec.argv else ""
    generic = {"python", f"python{sys.version_info[0]}", f"python{sys.version_info[0]}.{sys.version_info[1]}"}
    if exe in generic or Path(exe).resolve() == Path(sys.executable).resolve():
        return None
    return (f"warning: the 'python3' kernel at {spec.resource_dir} runs {exe}, not this environment's "
            f"{sys.executable}; pick this environment's kernel in JupyterLab or remove that kernelspec")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="grpo-lab lab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=None, help="folder JupyterLab serves (default: the checkout's root)")
    ap.add_argument("--port", type=int, default=8888)
    ap.add_argument("--no-browser", action="store_true", help="print the URL instead of opening a browser")
    ap.add_argument("--print-command", action="store_true", help="print the command and exit")
    a = ap.parse_args(argv)
    if importlib.util.find_spec("jupyterlab") is None:
        print(f"error: JupyterLab is not installed here: {install_hint('notebooks')} (or run scripts/lab.sh from "
              "a clone)", file=sys.stderr)
        return 2
    cmd = lab_command(a.root, a.port, not a.no_browser, extra)
    if a.print_command:
        print(" ".join(cmd))
        return 0
    warning = kernel_mismatch()
    if warning:
        print(warning, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
