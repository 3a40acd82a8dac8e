"""One workdir, one run: a lock file, <workdir>/run.lock, that a training run holds.

Two runs in one workdir would overwrite each other's checkpoints and interleave their
metrics, so a run takes the lock before it writes anything and refuses to start while
another run holds it. The file (JSON) names the holder: host, pid, boot id, start time and
a heartbeat that a background thread refreshes every `HEARTBEAT_S` seconds (also through
long compiles and evaluations, which a refresh at log steps would miss).

A lock whose holder is gone is taken over with a warning, so that a preempted run resumes
without a manual step: on the same host when no process has its pid (or the machine has
rebooted since), from another host when its heartbeat is older than `STALE_AFTER_S`.
`force=True` (`--force_unlock`) takes any lock.

What is atomic: on a local (or mounted) disk the file is created with O_CREAT | O_EXCL, so of
two runs that start together exactly one gets it. Buckets (gs:// through tf.io.gfile) have
no create-if-absent: two runs that start within a second of each other may both write the
file. The last write wins, and the other run finds the file naming another run at its next
heartbeat and stops at the log step after it (`check`). The same holds for two runs that take
over one abandoned lock at the same moment (a removal, then a create), on any filesystem.
The pid test assumes that a host name names one pid namespace: containers that share a host
name but not their pids should not share a workdir.

Light on purpose (no JAX; TensorFlow only for remote paths), so that it is tested fast.
"""

import dataclasses
import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid

from absl import logging

from rspc_jax import ReportedError

LOCK_NAME = "run.lock"
HEARTBEAT_S = 60.0
# A lock from another host whose heartbeat is older than this is taken as abandoned: ten
# missed heartbeats, far beyond a slow bucket write, well within a relaunch after preemption.
STALE_AFTER_S = 600.0


class WorkdirLockedError(ReportedError, RuntimeError):
    """Another run holds (or took over) the workdir's lock."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock: what run.lock records."""

    host: str
    pid: int
    boot_id: str  # this boot of the host: a pid from before a reboot names no process
    started: float  # seconds since the epoch
    heartbeat: float
    token: str  # tells this run's lock from a later one of the same pid

    def describe(self, now: float) -> str:
        """'pid 12 on host h, running since YYYY-MM-DD HH:MM:SS UTC (last heartbeat 5 s ago)'."""
        started = datetime.datetime.fromtimestamp(self.started, datetime.UTC)
        return (
            f"pid {self.pid} on host {self.host}, running since "
            f"{started:%Y-%m-%d %H:%M:%S} UTC (last heartbeat {now - self.heartbeat:.0f} s ago)"
        )


def _boot_id() -> str:
    """Linux's id of this boot ('' elsewhere)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_alive(pid: int) -> bool:
    """Whether a process with `pid` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_abandoned(holder: Holder, now: float) -> bool:
    """Whether `holder` is gone: on this host, its process (or its boot) is; from another
    host, its heartbeat stopped more than STALE_AFTER_S ago."""
    if holder.host == socket.gethostname():
        if holder.boot_id and holder.boot_id != _boot_id():
            return True
        return not _pid_alive(holder.pid)
    return now - holder.heartbeat > STALE_AFTER_S


def _is_remote(path: str) -> bool:
    return "://" in path


def _encode(holder: Holder) -> bytes:
    return json.dumps(dataclasses.asdict(holder), indent=2).encode()


def _create(path: str, data: bytes) -> bool:
    """Writes `data` to a new file `path`; False when the file exists. Atomic on local
    disks (O_EXCL); on buckets a check followed by a write (see the module's docstring)."""
    if _is_remote(path):
        import tensorflow as tf

        if tf.io.gfile.exists(path):
            return False
        with tf.io.gfile.GFile(path, "wb") as f:
            f.write(data)
        return True
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return True


def _replace(path: str, data: bytes) -> None:
    """Overwrites `path` with `data` so that a reader never sees half of it (a rename on
    local disks; a bucket's object write is atomic by itself)."""
    if _is_remote(path):
        import tensorflow as tf

        with tf.io.gfile.GFile(path, "wb") as f:
            f.write(data)
        return
    temporary = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def _read_bytes(path: str) -> bytes | None:
    """The file's bytes, None when it does not exist."""
    try:
        if _is_remote(path):
            import tensorflow as tf

            with tf.io.gfile.GFile(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, _not_found_errors()):
        return None


def _not_found_errors() -> type[Exception] | tuple:
    """tf.errors.NotFoundError where TensorFlow is loaded (a bucket path), else nothing."""
    tf = sys.modules.get("tensorflow")
    return tf.errors.NotFoundError if tf is not None else ()


def _remove(path: str) -> None:
    """Removes `path`; one already gone (another run released or took it) is fine."""
    try:
        if _is_remote(path):
            import tensorflow as tf

            tf.io.gfile.remove(path)
        else:
            os.remove(path)
    except (FileNotFoundError, _not_found_errors()):
        pass


def _modified(path: str) -> float:
    """When `path` was last written, in seconds since the epoch (now if it is gone)."""
    try:
        if _is_remote(path):
            import tensorflow as tf

            return tf.io.gfile.stat(path).mtime_nsec / 1e9
        return os.path.getmtime(path)
    except (FileNotFoundError, _not_found_errors()):
        return time.time()


def read(path: str) -> Holder | None:
    """The holder the lock file at `path` names; None when there is no lock. A file that
    cannot be parsed (a run killed while it created the file) reads as a holder of unknown
    host and pid (-1) whose heartbeat is the file's time, so it is taken over only once
    that is older than STALE_AFTER_S."""
    data = _read_bytes(path)
    if data is None:
        return None
    try:
        return Holder(**json.loads(data))
    except (ValueError, TypeError):
        written = _modified(path)
        return Holder(host="?", pid=-1, boot_id="", started=written, heartbeat=written, token="")


class WorkdirLock:
    """The lock this run holds on a workdir; `release()` gives it up."""

    def __init__(self, path: str, holder: Holder, heartbeat_s: float = HEARTBEAT_S):
        self.path = path
        self.holder = holder
        self._lost: Holder | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, args=(heartbeat_s,), name="workdir-lock-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self, every_s: float) -> None:
        """Refreshes the heartbeat until released or lost to another run."""
        while not self._stop.wait(every_s) and self._lost is None:
            try:
                self.refresh()
            # A bucket hiccup (tf.errors are no OSErrors) must not end the heartbeat: the
            # next beat tries again.
            except Exception as error:
                logging.warning("could not refresh the workdir lock %s: %s", self.path, error)

    def refresh(self) -> None:
        """Writes a new heartbeat, unless the file now names another run (then `check`
        reports it)."""
        current = read(self.path)
        if current is None or current.token != self.holder.token:
            self._lost = current
            return
        self.holder = dataclasses.replace(self.holder, heartbeat=time.time())
        _replace(self.path, _encode(self.holder))

    def check(self) -> None:
        """Raises WorkdirLockedError when another run took this lock over (see the module's
        docstring: two runs started together on a bucket, or a --force_unlock)."""
        if self._lost is None:
            return
        other = self._lost.describe(time.time()) if self._lost.pid >= 0 else "the lock was removed"
        raise WorkdirLockedError(
            f"another run took over the lock {self.path} of this run's workdir ({other}); "
            "this run stops so that the two do not overwrite each other's checkpoints. "
            "Checkpoints up to the last save are kept; rerun with another --workdir, or "
            "rerun this one once the other run has ended."
        )

    def release(self) -> None:
        """Stops the heartbeat and removes the lock file if it still names this run."""
        self._stop.set()
        self._thread.join()
        current = read(self.path)
        if current is not None and current.token == self.holder.token:
            _remove(self.path)


def _refusal(path: str, holder: Holder, now: float) -> WorkdirLockedError:
    """The paragraph of a run refused by a live lock."""
    who = (
        holder.describe(now)
        if holder.pid >= 0
        else "a lock file that cannot be read (a run killed while it created the lock?)"
    )
    return WorkdirLockedError(
        f"the workdir {os.path.dirname(path)} is in use by another run: {who} holds {path}. "
        "Two runs in one workdir would overwrite each other's checkpoints and interleave "
        "their metrics. Wait for that run to end, pass another --workdir, or, if you know "
        "that run is dead (e.g. its machine is gone), rerun with --force_unlock. A lock "
        "whose run died on this host, or whose heartbeat stopped more than "
        f"{STALE_AFTER_S / 60:.0f} minutes ago, is taken over without --force_unlock."
    )


def acquire(workdir: str, *, force: bool = False, heartbeat_s: float = HEARTBEAT_S) -> WorkdirLock:
    """Takes <workdir>/run.lock for this process (the workdir exists); takes over a lock
    whose holder is gone (with a warning), or any lock with `force`; raises
    WorkdirLockedError naming the holder otherwise."""
    path = os.path.join(workdir, LOCK_NAME)
    now = time.time()
    mine = Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        boot_id=_boot_id(),
        started=now,
        heartbeat=now,
        token=uuid.uuid4().hex,
    )
    for _ in range(3):  # a lock released, or taken over by another run, between two calls
        if _create(path, _encode(mine)):
            return WorkdirLock(path, mine, heartbeat_s)
        holder = read(path)
        if holder is None:
            continue
        if not (force or is_abandoned(holder, now)):
            raise _refusal(path, holder, now)
        reason = "--force_unlock" if force else "its run is gone"
        logging.warning(
            "Taking over the workdir lock %s (%s): it was held by %s.",
            path,
            reason,
            holder.describe(now) if holder.pid >= 0 else "an unreadable lock file",
        )
        _remove(path)
    raise _refusal(path, read(path) or mine, now)
