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


# Prepended to compiled_for_hopper's scripts: sm90_tool compiles a kernel for sm_90 and runs
# one of triton's CUDA binary tools on the cubin.
HOPPER_TOOLS = """
import inspect
import os
import subprocess
import tempfile
import triton
from triton.backends import nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def sm90_tool(kernel, const, ptrs, warps, stages, tool, *flags):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n == "eps" else "i32")
           for n in names}
    aligned = {(j,): [["tt.divisibility", 16]] for j, n in enumerate(names)
               if n in ptrs or n.startswith("stride") or n in ("N", "K")}
    compiled = triton.compile(ASTSource(kernel, sig, const, aligned),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(os.path.dirname(nvidia.__file__), "bin", tool),
                               *flags, f.name], capture_output=True, text=True,
                              check=True).stdout
"""


def compiled_for_hopper(script: str, *args: str) -> str:
    """The stdout of script (after HOPPER_TOOLS: sm90_tool(kernel, const, pointer types, warps,
    stages, tool, *flags) gives a CUDA binary tool's output on the kernel compiled for sm_90,
    pointers, strides, N and K 16-byte aligned as a launch specializes them) run with args in a
    process of its own, without TRITON_INTERPRET (this one runs triton's interpreter), so it
    compiles for the GPU; fails the test with the script's stderr if it fails."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", HOPPER_TOOLS + script, *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
