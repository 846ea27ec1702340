"""Admin changes shared by the proxy's worker processes (``--workers N``).

An admin call lands on whichever worker the kernel handed its connection to, and each worker routes with its own
registry. So a change (add, remove, drain, resume an instance) is appended to one journal file that every worker
follows, and the call is answered once every worker has applied it (or after a wait, saying how many had). A worker
that (re)starts replays the journal from its start, so it joins with the instances and drains the others have.

Pure file I/O, no event loop: the proxy polls ``new_entries`` from its background task and waits with
``applied_by``. Entries are JSON lines; a worker's progress is one small file it replaces atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from typing import Any

JOURNAL = "admin.jsonl"


class AdminJournal:
    def __init__(self, directory: str, worker: int, workers: int) -> None:
        self.directory = directory
        self.worker = worker
        self.workers = workers
        self.path = os.path.join(directory, JOURNAL)
        self._offset = 0  # bytes of the journal read so far
        self._seq = 0  # entries read so far (an entry's seq is its line number, from 1)

    def append(self, entry: dict[str, Any]) -> int:
        """Add a change for every worker; its seq (line number)."""
        line = json.dumps(entry, separators=(",", ":")).encode() + b"\n"
        with open(self.path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.seek(0)
                seq = f.read().count(b"\n") + 1
                f.write(line)
                f.flush()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return seq

    def new_entries(self) -> list[tuple[int, dict[str, Any]]]:
        """The entries appended since the last call (whole lines only), with their seqs."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        out = []
        for raw in data[: end + 1].splitlines():
            self._seq += 1
            with contextlib.suppress(ValueError):
                out.append((self._seq, json.loads(raw)))
        self._offset += end + 1
        return out

    def mark_applied(self, seq: int) -> None:
        """This worker has applied every entry up to ``seq``."""
        tmp = os.path.join(self.directory, f".applied-{self.worker}.{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(str(seq))
        os.replace(tmp, self._applied_path(self.worker))

    def applied_by(self, seq: int) -> int:
        """How many workers have applied the entries up to ``seq``."""
        n = 0
        for w in range(self.workers):
            try:
                with open(self._applied_path(w)) as f:
                    done = int(f.read() or 0)
            except (FileNotFoundError, ValueError):
                done = 0
            n += done >= seq
        return n

    def _applied_path(self, worker: int) -> str:
        return os.path.join(self.directory, f"applied-{worker}")


def undone_later(entries: list[tuple[int, dict[str, Any]]]) -> set[int]:
    """The seqs of changes a later entry of the same batch undoes: an add, drain or resume of an instance removed
    further on. A restarted worker replays the whole journal as one batch, and adding an instance removed since
    would probe it (a pod that is gone: up to the connect timeout each) only to remove it again."""
    removed_at: dict[str, int] = {}
    for seq, change in entries:
        if change.get("op") == "remove":
            removed_at[str(change.get("id", ""))] = seq
    if not removed_at:
        return set()
    return {
        seq
        for seq, change in entries
        if change.get("op") in ("add", "drain", "resume")
        and removed_at.get(str(change.get("id", "")), 0) > seq
    }
