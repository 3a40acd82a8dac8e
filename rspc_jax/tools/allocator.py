"""tcmalloc for the command-line tools, where the system has it.

XLA:CPU takes each call's temporaries (hundreds of MB for a ViT train step) from malloc and
frees them after the call. glibc serves blocks that large with a fresh mmap and unmaps them on
free, so the kernel zeroes every page again on every step, a large share of a CPU step's time
(docs/speed.md, "CPU: tcmalloc"), and no glibc setting keeps them without slowing every thread.
tcmalloc keeps freed pages for the next call. A process picks its allocator when it starts,
so a tool re-executes itself once with tcmalloc preloaded, before JAX is imported.

No Python package ships tcmalloc; it is the OS's (Debian/Ubuntu: libtcmalloc-minimal4,
Fedora: gperftools-libs). Without it, or with `--malloc=system`, nothing changes.
"""

import ctypes.util
import functools
import os
import sys

# Set on the re-executed process: a preload that did not take is not retried.
_TRIED = "RSPC_JAX_TCMALLOC_TRIED"
# gperftools prints a line with a stack trace for every allocation over 1 GiB by default;
# the step's temporaries are that large.
_REPORT_THRESHOLD = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"
_LIBRARIES = ("tcmalloc_minimal", "tcmalloc")


def loaded_tcmalloc() -> str | None:
    """The tcmalloc library mapped into this process (preloaded or linked), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libtcmalloc"):
                    return path
    except OSError:  # not Linux
        pass
    return None


@functools.cache  # each lookup runs ldconfig; start-up and the benchmark header ask again
def find_tcmalloc() -> str | None:
    """The system's tcmalloc shared library (a name the dynamic loader resolves), if any."""
    for name in _LIBRARIES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def preload_environment(environ: dict, library: str) -> dict:
    """`environ` for a process that starts with `library` preloaded."""
    preload = " ".join(filter(None, (library, environ.get("LD_PRELOAD", ""))))
    return {
        **environ,
        "LD_PRELOAD": preload,
        _TRIED: library,
        _REPORT_THRESHOLD: environ.get(_REPORT_THRESHOLD, str(1 << 50)),
    }


def _users_allocator() -> str | None:
    """An allocator the user preloaded (jemalloc, mimalloc, ...): theirs to keep."""
    for library in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        name = os.path.basename(library)
        if "malloc" in name and not name.startswith("libtcmalloc"):
            return library
    return None


def describe() -> str:
    """One line naming this process's allocator, for logs and benchmark headers."""
    library = loaded_tcmalloc()
    if library:
        return f"tcmalloc ({library})"
    users = _users_allocator()
    if users:
        return f"the preloaded {users}"
    if os.environ.get(_TRIED):
        return f"the C library's ({os.environ[_TRIED]} could not be preloaded)"
    if find_tcmalloc():
        return (
            "the C library's (tcmalloc is installed: the tools preload it unless --malloc=system)"
        )
    return "the C library's (no tcmalloc found; installing it makes CPU steps faster)"


def reexecute_with_tcmalloc() -> None:
    """Replaces this process by the same command with tcmalloc preloaded, when the system
    has tcmalloc and this process neither has it, nor has tried it, nor has another allocator
    preloaded. Returns otherwise."""
    if not sys.platform.startswith("linux") or os.environ.get(_TRIED):
        return
    if loaded_tcmalloc() or _users_allocator():
        return
    library = find_tcmalloc()
    if library is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    command = [sys.executable, *sys.orig_argv[1:]]
    os.execve(sys.executable, command, preload_environment(dict(os.environ), library))
