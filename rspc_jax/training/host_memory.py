"""Host memory that compiling leaves behind. XLA's compiler threads free what they used, but
the allocator keeps it (glibc in its per-thread arenas, tcmalloc in its page heap), so the
train step's buffers, allocated next, come on top of it: 0.3 GB for DeiT-S and 0.85 GB for
RVT-Ti* in the process's peak on CPU with glibc (docs/speed.md, "CPU: host memory of one
step"). No library exposes either allocator's release call, hence ctypes."""

import ctypes


def release_freed_memory() -> None:
    """Returns the allocator's free pages to the OS: tcmalloc's where it is preloaded
    (rspc_jax.tools.allocator), else glibc's malloc_trim(0); nothing where the C library has
    neither (macOS, musl)."""
    try:
        process = ctypes.CDLL(None)
    except OSError:
        return
    tcmalloc = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if tcmalloc is not None:
        tcmalloc()
        return
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim(0)
