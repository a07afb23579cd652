"""Host memory freed by a process given back to the system at once.

glibc keeps freed memory in its heap unless the block was mapped on its own, and decides which blocks are mapped
on their own by a threshold that rises as the process frees large blocks: whether freeing a tensor's storage lowers
the process's resident size depends on what the process allocated and freed before. Where freeing is the point
(an engine releasing its weights for a colocated trainer), :func:`return_free_memory` hands back every free page of
the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["return_free_memory"]


def return_free_memory() -> bool:
    """Give the system the pages glibc's heap holds free (``malloc_trim(0)``); False where the C library is not
    glibc (nothing is done there)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # no glibc: its heap is not this one
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
