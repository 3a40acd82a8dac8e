"""Host memory of the train step on CPU: the allocator's free pages go back to the OS after
compiling, and a step waits until XLA:CPU has returned its temporaries."""

import contextlib
import ctypes
import time

import pytest

from rspc_jax.training import host_memory
from tests.conftest import run_python, system_tcmalloc

_MIB = 2**20


@contextlib.contextmanager
def _allocated_as(monkeypatch, values):
    """host_memory.allocated_bytes returns `values` one by one (the last one from then on);
    yields the list of values read."""
    remaining, read = list(values), []

    def allocated_bytes():
        value = remaining.pop(0) if len(remaining) > 1 else remaining[0]
        read.append(value)
        return value

    monkeypatch.setattr(host_memory, "allocated_bytes", allocated_bytes)
    yield read


def test_the_wait_ends_once_the_temporaries_are_back(monkeypatch):
    """Before the call 100 MiB; the 256 MiB of temporaries are still out for two reads after
    it, then back: the wait reads until then and no further."""
    values = [100 * _MIB, 356 * _MIB, 356 * _MIB, 101 * _MIB, 356 * _MIB]
    with _allocated_as(monkeypatch, values) as read:
        with host_memory.temporaries_returned(256 * _MIB):
            pass
    assert read == values[:4]


def test_the_wait_gives_up_after_a_tenth_of_a_second(monkeypatch):
    """Temporaries that never come back (another thread holds as much) cost 0.1 s, not a
    hang."""
    with _allocated_as(monkeypatch, [100 * _MIB, 356 * _MIB]) as read:
        start = time.monotonic()
        with host_memory.temporaries_returned(256 * _MIB):
            pass
        waited = time.monotonic() - start
    assert 0.1 <= waited < 1.0, waited
    assert len(read) > 2


def test_no_wait_without_tcmalloc_or_for_small_temporaries(monkeypatch):
    """glibc unmaps large blocks on free (allocated_bytes is None there), and temporaries
    under 64 MiB are not worth a wait: nothing is read after the call."""
    with _allocated_as(monkeypatch, [None]) as read:
        with host_memory.temporaries_returned(256 * _MIB):
            pass
    assert read == [None]
    with _allocated_as(monkeypatch, [100 * _MIB, 356 * _MIB]) as read:
        with host_memory.temporaries_returned(32 * _MIB):
            pass
    assert read == []


_RELEASE_SCRIPT = """
import threading
from rspc_jax.training import host_memory

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024

kept = []

def churn():
{churn}

thread = threading.Thread(target=churn)
thread.start()
thread.join()
before = rss_mib()
host_memory.release_freed_memory()
print(before, rss_mib())
"""
# What each allocator keeps after a thread frees it: glibc the 64 KiB blocks under one still
# in use (off its arena's top), tcmalloc a 300 MiB block (zeroed, so every page is touched).
_CHURN = {
    "glibc": """    blocks = [bytearray(64 * 1024) for _ in range(4000)]
    kept.append(blocks[-1])
    blocks.clear()""",
    "tcmalloc": """    block = bytearray(300 * 2**20)
    del block""",
}


@pytest.mark.parametrize("kind", ["glibc", "tcmalloc"])
def test_released_memory_leaves_the_process(kind):
    """The allocator keeps 250+ MiB that a thread freed; the release returns it to the OS
    (glibc's malloc_trim, or tcmalloc's, which the tools preload where installed)."""
    preload = system_tcmalloc() if kind == "tcmalloc" else ""
    if kind == "glibc" and not hasattr(ctypes.CDLL(None), "malloc_trim"):
        pytest.skip("the C library has no malloc_trim (not glibc)")
    script = _RELEASE_SCRIPT.format(churn=_CHURN[kind])
    result = run_python(["-c", script], timeout=120, env_extra={"LD_PRELOAD": preload})
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = map(int, result.stdout.split())
    assert before - after > 200, (before, after)


_RETURNED_SCRIPT = """
import jax
import jax.numpy as jnp
from rspc_jax.training import host_memory

def loss(weights, x):
    for w in weights:
        x = jnp.tanh(x @ w)
    return (x ** 2).sum()

weights = [jnp.full((512, 512), 0.01)] * 8
x = jnp.ones((16384, 512))
step = jax.jit(jax.grad(loss)).lower(weights, x).compile()
temp_bytes = host_memory.host_temporary_bytes(step)
excess = []
for _ in range(10):
    before = host_memory.allocated_bytes()
    with host_memory.temporaries_returned(temp_bytes):
        jax.block_until_ready(step(weights, x))
    excess.append(host_memory.allocated_bytes() - before)
print(temp_bytes, max(excess))
"""


def test_with_tcmalloc_each_call_gives_its_temporaries_back_before_the_next():
    """A gradient with 288 MiB of temporaries, called 10 times in a process with tcmalloc:
    after each wait at most half of them are still out (XLA:CPU frees them on its own
    thread after the outputs are ready)."""
    library = system_tcmalloc()
    result = run_python(["-c", _RETURNED_SCRIPT], timeout=300, env_extra={"LD_PRELOAD": library})
    assert result.returncode == 0, result.stderr[-2000:]
    temp_bytes, excess = map(int, result.stdout.split())
    assert temp_bytes >= 256 * _MIB, temp_bytes
    assert excess <= temp_bytes // 2, (temp_bytes, excess)


def test_the_loops_hook_compiles_releases_then_waits_for_the_largest_temporaries(monkeypatch):
    """StepMemory.compiled_ahead compiles every lowered program before anything is released;
    each step call then waits for the largest program's temporaries where the calls block
    on their outputs, and for none where they do not."""
    events = []

    class Lowered:
        def __init__(self, temp_bytes):
            self.temp_bytes = temp_bytes

        def compile(self):
            events.append(("compile", self.temp_bytes))
            return self

    @contextlib.contextmanager
    def temporaries_returned(temp_bytes):
        events.append(("wait", temp_bytes))
        yield

    monkeypatch.setattr(host_memory, "host_temporary_bytes", lambda program: program.temp_bytes)
    monkeypatch.setattr(host_memory, "release_freed_memory", lambda: events.append("release"))
    monkeypatch.setattr(host_memory, "temporaries_returned", temporaries_returned)
    for calls_block, waited in ((True, 300 * _MIB), (False, 0)):
        events.clear()
        programs = [Lowered(100 * _MIB), Lowered(300 * _MIB)]
        memory = host_memory.StepMemory.compiled_ahead(programs, calls_block=calls_block)
        with memory.step_call():
            pass
        memory.release()
        assert events == [
            ("compile", 100 * _MIB),
            ("compile", 300 * _MIB),
            "release",
            ("wait", waited),
            "release",
        ]
