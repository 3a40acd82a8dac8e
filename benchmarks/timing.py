"""Wall time per call and process memory, measured the same way for our steps and for the
PyTorch references they are compared with (which import this module in their own process,
so it imports nothing heavy)."""

import os
import time


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under `taskset` or a
    container's cpuset), which is what PyTorch's thread pool should match: more threads
    than cores time-share them and slow PyTorch's steps down."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def time_calls(call, count: int) -> tuple[list[float], float]:
    """Seconds of each of `count` calls of `call` (which must block), and the process's CPU
    time over their wall time: how many cores the calls kept busy, spin-waiting included."""
    times = []
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    for _ in range(count):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times, (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss it starts afresh at exec,
    so a child started from a big parent reports its own)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")
