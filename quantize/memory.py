"""Keep peak RSS bounded when large tensors are allocated and freed over and over (glibc)."""

import ctypes

__all__ = ["bound_allocator", "release_freed_memory"]

try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim
except (OSError, AttributeError):  # not glibc
    _LIBC = None

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def bound_allocator() -> None:
    """Serve every allocation of 1 MiB or more with its own mmap (glibc ``mallopt``).

    glibc otherwise raises its mmap threshold after the first large free and carves later
    tensors out of the heap, where fragmentation makes peak RSS creep up shard after shard
    (or layer after layer); with a fixed threshold peak RSS stays flat (FC-04).
    """
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
