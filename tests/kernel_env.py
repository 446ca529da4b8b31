"""Imported by the kernel test files before any kernel module. Without CUDA the triton-language
kernels run under TRITON_INTERPRET=1, which triton reads when it decorates a kernel: kernel
modules imported before without it are dropped, to be imported again in interpreter mode."""
import os
import sys

import torch

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    if "pagedbackend.kernels.common" in sys.modules \
            and not sys.modules["pagedbackend.kernels.common"].INTERPRET:
        for name in [m for m in sys.modules if m.startswith("pagedbackend.kernels")]:
            del sys.modules[name]


def compiled_for_hopper(script: str, *args: str) -> str:
    """The stdout of script run with args in a process of its own, without TRITON_INTERPRET
    (this one runs triton's interpreter, kernel_env), so it compiles for the GPU target it
    names; fails the test with the script's stderr if it fails."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
