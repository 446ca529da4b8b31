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
