"""Host arenas: one contiguous, pre-faulted byte buffer per slot.

Copying into freshly allocated memory pays a page fault per 4 KiB page; measured
here that runs ~10x slower than copying into a buffer whose pages are already
mapped, so arenas are populated once when allocated and then reused for the
life of the slot.

:func:`populate` maps the pages of a range without writing it
(``madvise(MADV_POPULATE_WRITE)``, Linux >= 5.14). Measured on this project's
2-core VMs it maps fresh memory ~1.5x faster than touching every page, and
receivers use it one chunk ahead of the bytes (see
:mod:`lm_resiliency.replication._link`), so mapping overlaps the transfer
instead of running as page faults inside it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import sys

import torch

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


def _load_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()
_populate_supported = _madvise is not None


def pinning_available() -> bool:
    """Whether page-locked host memory can be allocated (a CUDA device is present)."""
    return torch.cuda.is_available()


def populate(view: torch.Tensor) -> bool:
    """Map every page under ``view`` (a contiguous CPU tensor) without changing its bytes.

    Returns ``False`` when the kernel cannot do it (not Linux, or older than
    5.14); the pages are then mapped by the first write as usual. Only pages
    of this process's own mapping are touched: the range is widened to page
    boundaries, which stay inside the allocation that holds ``view`` or its
    allocator's bookkeeping page.
    """
    global _populate_supported
    if not _populate_supported or view.numel() == 0:
        return False
    if view.device.type != "cpu" or not view.is_contiguous():
        raise ValueError("populate() needs a contiguous CPU tensor")
    start = view.data_ptr()
    end = start + view.numel() * view.element_size()
    aligned = start - start % _PAGE
    assert _madvise is not None
    if _madvise(aligned, end - aligned, _MADV_POPULATE_WRITE) == 0:
        return True
    errno = ctypes.get_errno()
    if errno == 22:  # EINVAL: this kernel has no MADV_POPULATE_WRITE
        _populate_supported = False
        log.info("madvise(MADV_POPULATE_WRITE) is not supported; pages map on first write")
    return False


def allocate_arena(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A flat ``uint8`` host tensor of ``nbytes`` bytes with every page already mapped.

    With ``pin=True`` and CUDA present the buffer is allocated page-locked
    directly (never pageable memory pinned afterwards). Run this off the
    training thread: mapping every page of a large arena takes time.
    """
    if nbytes < 0:
        raise ValueError(f"arena size must be >= 0 bytes, got {nbytes}")
    pinned = pin and pinning_available()
    arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    if pinned or not populate(arena):
        # Page-locked memory is touched once as before (it is mapped, the memset only
        # warms it); without MADV_POPULATE_WRITE every page is touched here.
        arena.zero_()
    return arena


def arena_is_pinned(arena: torch.Tensor) -> bool:
    """Whether ``arena`` is page-locked (always ``False`` without CUDA)."""
    return pinning_available() and arena.is_pinned()
