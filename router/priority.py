"""The CPU priority of the proxy's background tokenizing (a worker thread, a worker process).

Nice 10, not the idle scheduling class: under ``SCHED_IDLE`` a tokenizer waits until every core is idle, and where
the proxy shares a host with busy engines none ever is (a 1,084-token prompt took 443 ms p50 to tokenize with both
cores of the development machine busy, against 1.4 ms at nice 10 and 16 ms at nice 19), so each request's routing
waited behind the engines it was routing to. At nice 10 the tokenizer still gets only about a tenth of a core its
event loop also wants (CFS weights 110 against 1,024), so a long prompt does not hold up the other streams.
"""

from __future__ import annotations

import contextlib
import os

BACKGROUND_NICE = 10


def background_priority(tid: int = 0) -> None:
    """Lower thread ``tid`` (0: the calling process's main thread) to ``BACKGROUND_NICE``; a host that refuses it
    leaves the priority as it was."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
