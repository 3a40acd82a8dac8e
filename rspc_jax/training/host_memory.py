"""Host memory that compiling leaves behind. XLA's compiler threads free what they used,
but glibc keeps freed memory mapped in its per-thread arenas, so the train step's buffers,
allocated next, come on top of it: 0.3 GB for DeiT-S and 0.85 GB for RVT-Ti* in the
process's peak on CPU (docs/speed.md, "CPU: host memory of one step"). No library exposes
glibc's malloc_trim, hence ctypes."""

import ctypes


def release_freed_memory() -> None:
    """Returns the free pages of every malloc arena to the OS (glibc's malloc_trim(0));
    nothing where the C library has no malloc_trim (macOS, musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
