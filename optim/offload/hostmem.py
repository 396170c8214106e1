"""Page-locked host buffers of exactly the size asked for.

``torch.empty(n, pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds each
block up to a power of two: a 3 GiB layer input pins 4 GiB, and 30 of them pin 120 GiB where
90 GiB would do. Offloaded checkpoints at long lengths are most of a host's memory, so the
offloader pins its own: an anonymous mapping of the exact size (page-aligned, sharing no page with
other allocations), registered with CUDA (``cudaHostRegister``, what the allocator's own
``pinned_use_cuda_host_register`` does) and unregistered by ``release`` once no copy uses it, or
when the tensor is collected.

A failed ``cudaHostRegister`` leaves the CUDA runtime's last error set, which torch's next kernel
launch check would raise; torch has no binding to clear it, so registering is tried only where
the process's libcudart can be reached to do so. Elsewhere (no such library, a failed
registration) the caching allocator's pinned block serves: rounded, but pinned.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref

import torch

log = logging.getLogger("optim.offload")
PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as the caching allocator's blocks are
_OWNED: dict[int, weakref.finalize] = {}  # data_ptr -> the finalizer that unregisters it


def pinned_empty(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes``, page-locked for asynchronous copies to and from CUDA.

    Hand it to ``release`` once no copy uses it (the caller synchronizes the stream that copies);
    collecting it unregisters it too, after synchronizing ``device``."""
    lib = _cudart()
    if nbytes == 0 or lib is None:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    t = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # the tensor keeps the mapping
    ptr = t.data_ptr()
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, PORTABLE))
    if err != 0:
        lib.cudaGetLastError()  # clear it: the next launch check would read it
        log.info("optim.offload: registering %d bytes of host memory failed (CUDA error %d); using the "
                 "caching allocator's pinned memory, rounded up to a power of two", nbytes, err)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    fin = weakref.finalize(t, _unregister, ptr, device, True)
    fin.atexit = False  # the process's end frees it all; unpinning ~100 GiB would only slow the exit
    _OWNED[ptr] = fin
    return t


def release(t: torch.Tensor) -> None:
    """Unpin ``t``'s pages now, where the caller has made sure no copy still uses them; a tensor
    ``pinned_empty`` did not register is left to its allocator."""
    fin = _OWNED.get(t.data_ptr())
    if fin is not None:
        fin.detach()
        _unregister(t.data_ptr(), None, False)


def _unregister(ptr: int, device: torch.device | None, collected: bool) -> None:
    _OWNED.pop(ptr, None)
    if collected:  # by the collector, whatever the GPU is doing: let its copies finish first
        try:
            if not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - unpinning is still tried
            log.debug("optim.offload: synchronizing before unpinning failed: %s", e)
    try:
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0 and (lib := _cudart()) is not None:
            lib.cudaGetLastError()
    except Exception as e:  # noqa: BLE001 - CUDA already gone: the process frees it all
        log.debug("optim.offload: unpinning host memory failed: %s", e)


_LIB: list = []


def _cudart():
    """The libcudart this process already loaded (by its soname, never loading another), or None."""
    if not _LIB:
        lib = None
        major = (torch.version.cuda or "").split(".")[0]
        if major and hasattr(os, "RTLD_NOLOAD"):
            try:
                lib = ctypes.CDLL(f"libcudart.so.{major}", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                lib = None
        _LIB.append(lib)
    return _LIB[0]
