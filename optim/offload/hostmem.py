"""Page-locked host buffers of exactly the size asked for.

``torch.empty(n, pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds each
block up to the next power of two: a 3 GiB layer input pins 4 GiB, and 30 of them pin 120 GiB where
90 GiB would do. Offloaded checkpoints at long lengths are most of a host's memory, so the
offloader pins its own: pageable memory of the exact size, registered with CUDA
(``cudaHostRegister``, what the allocator's own ``pinned_use_cuda_host_register`` does) and
unregistered when the buffer goes. Where registering fails, the caching allocator's pinned block
serves (rounded, but pinned).
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import torch

log = logging.getLogger("optim.offload")
PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as the caching allocator's blocks are


def pinned_empty(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes``, page-locked for asynchronous copies to and from CUDA.

    The caller keeps the returned tensor for as long as copies may use it: its memory is
    unregistered when the tensor object is collected, once ``device`` (the current one where
    None) has finished what it was given."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0:
        return t
    ptr = t.data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, PORTABLE)
    if int(err) != 0:
        _clear_last_error()  # the failed call's error stays set, and a later launch check would read it
        log.info("optim.offload: registering %d bytes of host memory failed (CUDA error %d); using the "
                 "caching allocator's pinned memory, rounded up to a power of two", nbytes, int(err))
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(t, _unregister, ptr, device)
    return t


def _unregister(ptr: int, device: torch.device | None) -> None:
    try:
        torch.cuda.synchronize(device)  # no copy may still read or write the pages when they unpin
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            _clear_last_error()
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone: the process frees it all
        pass


def _clear_last_error() -> None:
    """Reset the CUDA runtime's last error (``cudaGetLastError``) through the libcudart this
    process loaded; torch exposes no binding for it."""
    lib = _cudart()
    if lib is not None:
        lib.cudaGetLastError()


_LIB: list = []


def _cudart():
    if not _LIB:
        path = None
        try:
            with open("/proc/self/maps") as f:
                path = next((line.split()[-1] for line in f if "libcudart.so" in line), None)
        except OSError:
            pass
        try:
            _LIB.append(ctypes.CDLL(path) if path else None)
        except OSError:
            _LIB.append(None)
    return _LIB[0]
