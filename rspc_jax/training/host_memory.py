"""Host memory of the train step on CPU, where XLA:CPU takes its buffers from malloc.

Compiling leaves memory behind: XLA's compiler threads free what they used, but the allocator
keeps it (glibc in its per-thread arenas, tcmalloc in its page heap), so the train step's
buffers, allocated next, would come on top of it in the process's peak.

A step's temporaries come back late: XLA:CPU frees them on a runtime thread just after the
step's outputs are ready. A next step that starts first takes a second block, and tcmalloc
(which the tools preload, rspc_jax.tools.allocator) keeps both for good: one more step's
temporaries in the process.

`StepMemory`, at the end, is what the training loop does about both; the functions before it
are its parts, which the benchmarks also use on their own. No library exposes either
allocator's calls, hence ctypes.
"""

import contextlib
import ctypes
import functools
import time

import jax

# Smaller temporaries are not worth a wait; none wait longer than this (seconds).
_WORTH_WAITING = 64 * 2**20
_LONGEST_WAIT = 0.1
_POLL_INTERVAL = 2e-4


@functools.cache
def _c_library():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def release_freed_memory() -> None:
    """Returns the allocator's free pages to the OS: tcmalloc's where it is preloaded, else
    glibc's malloc_trim(0); nothing where the C library has neither (macOS, musl)."""
    process = _c_library()
    tcmalloc = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if tcmalloc is not None:
        tcmalloc()
        return
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim(0)


def allocated_bytes() -> int | None:
    """Bytes tcmalloc has handed out and not had back; None without tcmalloc."""
    get_property = getattr(_c_library(), "MallocExtension_GetNumericProperty", None)
    if get_property is None:
        return None
    value = ctypes.c_size_t(0)
    if not get_property(b"generic.current_allocated_bytes", ctypes.byref(value)):
        return None
    return value.value


@contextlib.contextmanager
def temporaries_returned(temp_bytes: int):
    """Around a step call that blocks on its outputs: on leaving, waits until the allocator
    has the call's `temp_bytes` of temporaries back (at most 0.1 s), so that the next call
    reuses their block. Waits for nothing without tcmalloc (glibc unmaps such blocks on
    free) or below 64 MiB."""
    before = allocated_bytes() if temp_bytes >= _WORTH_WAITING else None
    yield
    if before is None:
        return
    deadline = time.monotonic() + _LONGEST_WAIT
    while allocated_bytes() > before + temp_bytes // 2 and time.monotonic() < deadline:
        time.sleep(_POLL_INTERVAL)


def host_temporary_bytes(compiled) -> int:
    """The temporaries a compiled program takes from malloc: XLA:CPU's; none on accelerators
    (their memory is the device's) or where the backend does not say."""
    analysis = compiled.memory_analysis()
    if jax.devices()[0].platform != "cpu" or analysis is None:
        return 0
    return analysis.temp_size_in_bytes


class StepMemory:
    """The training loop's one hook into host memory, made once before the first step by
    `compiled_ahead`: each step call runs in `step_call()`, and `release()` follows each
    evaluation (the first one compiles the eval steps)."""

    def __init__(self, temp_bytes: int):
        self._temp_bytes = temp_bytes

    @classmethod
    def compiled_ahead(cls, lowered: list, *, calls_block: bool, check=None) -> "StepMemory":
        """Compiles the lowered step programs before the first step runs (which then finds
        them cached) and returns the compiler's freed memory to the OS before the step's
        buffers are allocated. Where the step calls block on their outputs
        (`calls_block`), each then waits for the largest program's temporaries.
        `check(programs)` sees the compiled programs before they are dropped (the loop's
        memory check, training.memory_check), so that nothing compiles twice."""
        programs = [program.compile() for program in lowered]
        if check is not None:
            check(programs)
        temp_bytes = max(map(host_temporary_bytes, programs))
        del programs
        release_freed_memory()
        return cls(temp_bytes if calls_block else 0)

    def step_call(self):
        """A context for one call of the step that blocks on its outputs: see
        `temporaries_returned`."""
        return temporaries_returned(self._temp_bytes)

    def release(self) -> None:
        """Returns what the allocator freed to the OS (`release_freed_memory`)."""
        release_freed_memory()
