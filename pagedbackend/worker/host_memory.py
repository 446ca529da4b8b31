"""Host memory for the host KV tier, registered with CUDA in place (cudaHostRegister).

Not torch's pinned allocator: that one rounds every size up to a power of two (a 20 GiB tier
would pin 32). CUDA registers whole pages, so the buffer is over-allocated by a page and the
registered range starts on a page boundary and covers whole pages of this buffer alone: a small
tier from malloc's heap never shares a page with another registration (a second engine's tier
in the same process). The range is unregistered before its memory can be freed: by close() at
the engine's shutdown, or by a finalizer when the owner is garbage-collected (which holds the
buffer until then). A failed registration leaves CUDA's last error set, where torch's next kernel
launch check would report it as its own; it is consumed here.
"""
from __future__ import annotations

import mmap
import weakref

import torch

PAGE = mmap.PAGESIZE
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class HostRegisterError(RuntimeError):
    def __init__(self, code: int, what: str):
        super().__init__(what)
        self.code = code


class RegisteredHostMemory:
    """`nbytes` of page-aligned host memory (`.bytes`, uint8), registered (pinned) with CUDA
    when `device` is a CUDA device; plain memory on the CPU. torch.empty's RuntimeError (the
    host cannot hold it) and HostRegisterError (CUDA could not pin it) are the caller's to
    explain."""

    def __init__(self, nbytes: int, device: torch.device):
        self.size = -(-max(nbytes, 1) // PAGE) * PAGE            # whole pages
        buf = torch.empty(self.size + PAGE, dtype=torch.uint8)
        start = -buf.data_ptr() % PAGE
        self.ptr = buf.data_ptr() + start
        self.bytes = buf[start:start + nbytes]
        self.pinned = device.type == "cuda"
        self._finalizer = None
        if self.pinned:
            err = torch.cuda.cudart().cudaHostRegister(self.ptr, self.size,
                                                       CUDA_HOST_REGISTER_PORTABLE)
            if int(err) != 0:
                _consume_last_error(device)
                raise HostRegisterError(int(err), self._explain(err))
            # holds buf: the memory outlives its registration whoever drops it first
            self._finalizer = weakref.finalize(self, _unregister, self.ptr, buf, device)
            self._finalizer.atexit = False       # at exit the process's mappings go anyway

    def close(self) -> None:
        """Unregister now (idempotent); the memory is freed once nothing views it."""
        if self._finalizer is not None:
            self._finalizer()

    @property
    def registered(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def _explain(self, err) -> str:
        code = int(err)
        try:
            name = torch.cuda.cudart().cudaGetErrorString(err)
        except Exception:                   # an older binding: the code alone
            name = "see cudaError_t"
        what = (f"pinning the host KV tier: cudaHostRegister of {self.size} bytes at "
                f"{self.ptr:#x} failed: error {code} ({name})")
        if code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
            what += ("; these pages belong to this buffer alone, so something else in the"
                     " process registered them and did not unregister them before freeing")
        return what


def _unregister(ptr: int, buf: torch.Tensor, device: torch.device) -> None:
    try:
        torch.cuda.synchronize(device)      # no copy still reads or writes the pages
    except RuntimeError:
        pass                                # a device in error: unpin anyway
    if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
        _consume_last_error(device)
    del buf                                  # freed only after the pages are unregistered


def _consume_last_error(device: torch.device) -> None:
    """A failing CUDA runtime call leaves its code as the thread's last error, which torch
    reads (and clears) only in its check after the next kernel launch, blaming that kernel.
    Launch one here, so the error is consumed now."""
    try:
        torch.zeros(1, device=device)
    except RuntimeError:
        pass
