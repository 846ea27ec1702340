"""Plain TCP listeners a test owns: a *trap* that accepts and says nothing, or a *sink* that answers every
connection with bytes that start like a ZMTP greeting and go on as junk, then hangs up."""

from __future__ import annotations

import random
import socket
import threading


class Listener:
    """A TCP listener on 127.0.0.1 that counts accepted connections; ``garbage`` answers each with junk bytes."""

    def __init__(self, garbage: bool, seed: int = 0) -> None:
        self.garbage = garbage
        self.accepted = 0
        self._seed = seed
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = random.Random(self._seed)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self.accepted += 1
            try:
                if self.garbage:
                    conn.sendall(
                        b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f" + rng.randbytes(rng.randrange(1, 300))
                    )
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
