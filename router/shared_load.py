"""In-flight requests per instance, shared by the proxy's worker processes (``--workers N``).

Every worker routes with the whole proxy's load, not its own share: one shared-memory table holds a slot per
instance id and a column per worker. A worker writes only its own column (no lock on the request path) and reads
the sum over all columns. Slots are assigned by instance id under a file lock, so every worker finds the same slot
whatever order it discovered the instances in. A worker that restarts zeroes its column first.

A worker holds the slots of the instances it has (a byte per worker and slot) and lets go of one when it removes
the instance. A slot no worker holds, with nothing in flight on it, is taken for a new id once no slot was ever
free: instance ids come and go for the proxy's whole life (a pod name per rollout), the table's slots do not.

Layout: a header of MAX_SLOTS ids (``ID_BYTES`` each, UTF-8, zero-padded), then ``workers x MAX_SLOTS`` int64
counts, then ``workers x MAX_SLOTS`` holder bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from multiprocessing import shared_memory

MAX_SLOTS = 1024
ID_BYTES = 128
_INT = 8


class SharedLoad:
    def __init__(self, shm: shared_memory.SharedMemory, workers: int, worker: int, owner: bool) -> None:
        self._shm = shm
        self.workers = workers
        self.worker = worker
        self._owner = owner
        buf = shm.buf
        assert buf is not None
        ids_end = MAX_SLOTS * ID_BYTES
        counts_end = ids_end + workers * MAX_SLOTS * _INT
        self._ids = buf[:ids_end]
        self._counts = buf[ids_end:counts_end].cast("q")
        self._holders = buf[counts_end : counts_end + workers * MAX_SLOTS]
        self._slots: dict[str, int] = {}
        self._lock_path = os.path.join(tempfile.gettempdir(), f"{shm.name}.lock")

    @staticmethod
    def size(workers: int) -> int:
        return MAX_SLOTS * ID_BYTES + workers * MAX_SLOTS * (_INT + 1)

    @classmethod
    def create(cls, workers: int) -> SharedLoad:
        """The supervisor's table (zeroed); workers attach to it by ``name``."""
        shm = shared_memory.SharedMemory(create=True, size=cls.size(workers))
        assert shm.buf is not None
        shm.buf[:] = bytes(len(shm.buf))
        return cls(shm, workers, -1, owner=True)

    @classmethod
    def attach(cls, name: str, workers: int, worker: int) -> SharedLoad:
        # Attaching registers the name with the resource tracker again; spawned workers share the supervisor's
        # tracker, whose set of names collapses the two, so the segment is unlinked once: by the supervisor's
        # close, or by the tracker when the supervisor and every worker are gone (a supervisor that was killed).
        shm = shared_memory.SharedMemory(name=name)
        table = cls(shm, workers, worker, owner=False)
        table._reset_own()
        return table

    @property
    def name(self) -> str:
        return self._shm.name

    def _reset_own(self) -> None:
        base = self.worker * MAX_SLOTS
        for i in range(MAX_SLOTS):
            self._counts[base + i] = 0
            self._holders[base + i] = 0

    def slot(self, instance_id: str) -> int:
        """The instance's slot (the same in every worker), assigned on first use."""
        cached = self._slots.get(instance_id)
        if cached is not None:
            return cached
        key = instance_id.encode()[:ID_BYTES].ljust(ID_BYTES, b"\0")
        with _locked(self._lock_path):
            free = unheld = -1
            for i in range(MAX_SLOTS):
                entry = bytes(self._ids[i * ID_BYTES : (i + 1) * ID_BYTES])
                if entry == key:
                    return self._hold(instance_id, i)
                if free < 0 and not entry.strip(b"\0"):
                    free = i
                elif unheld < 0 and free < 0 and self._unused(i):
                    unheld = i
            if free < 0:
                free = unheld
            if free < 0:
                raise RuntimeError(
                    f"more than {MAX_SLOTS} instances in use at once: no shared slot for {instance_id!r}"
                )
            # a reused slot's counts sum to nothing in flight already; they are left as they are (a worker may
            # be releasing a request of the old instance this moment, unlocked: zeroed, it would leave -1)
            self._ids[free * ID_BYTES : (free + 1) * ID_BYTES] = key
            return self._hold(instance_id, free)

    def _hold(self, instance_id: str, slot: int) -> int:
        self._holders[self.worker * MAX_SLOTS + slot] = 1
        self._slots[instance_id] = slot
        return slot

    def _unused(self, slot: int) -> bool:
        """No worker holds the slot and nothing is in flight on it: its id may be replaced."""
        return self.total(slot) == 0 and not any(
            self._holders[w * MAX_SLOTS + slot] for w in range(self.workers)
        )

    def release(self, instance_id: str) -> None:
        """This worker no longer has the instance (removed): its slot may go to another id once no worker holds it
        and its requests in flight have ended."""
        slot = self._slots.pop(instance_id, None)
        if slot is not None:
            self._holders[self.worker * MAX_SLOTS + slot] = 0

    def add(self, slot: int, delta: int) -> None:
        """Change this worker's own count for ``slot``."""
        i = self.worker * MAX_SLOTS + slot
        self._counts[i] = self._counts[i] + delta

    def total(self, slot: int) -> int:
        """Requests in flight on the slot's instance, over all workers (read on every plan: a plain loop)."""
        counts = self._counts
        n, i = 0, slot
        for _ in range(self.workers):
            n += counts[i]
            i += MAX_SLOTS
        return n

    def close(self) -> None:
        self._ids.release()
        self._counts.release()
        self._holders.release()
        self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._lock_path)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """The table's slot assignment, one worker at a time."""
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
