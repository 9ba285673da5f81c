"""Memory a process frees goes back to the system when it is freed.

glibc's malloc serves an allocation from its heaps unless it is at least a threshold that it
raises, up to 32 MiB, each time a larger block is freed; and a heap gives memory back only from
its top. A learner's and the synchronizer's big tensors (a round's weights, a phase's delta, the
merge's chunks) are mostly 1–32 MiB each, so after the first large free they came from the heap,
and what a replaced round or a written delta left there stayed resident, phase after phase: a
180M-parameter learner's heap grew to 5 GiB. A fixed threshold (which also stops its raising)
gives every block of at least THRESHOLD a mapping of its own, unmapped when freed, so the
resident size follows what is held.

The processes a learner starts (a phase's torchrun job and its ranks) get the same threshold
through glibc's GLIBC_TUNABLES, which a new process reads before its first allocation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
THRESHOLD = 1 << 20
TUNABLE = "glibc.malloc.mmap_threshold"


def return_freed_memory() -> bool:
    """Set glibc's mmap threshold to THRESHOLD for this process's later allocations and for the
    processes it starts; False where the C library is not glibc (nothing changes there)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # no C library found, or one without mallopt (musl)
        return False
    if not mallopt(M_MMAP_THRESHOLD, THRESHOLD):
        return False
    others = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith(TUNABLE + "=")]
    os.environ["GLIBC_TUNABLES"] = ":".join([*others, f"{TUNABLE}={THRESHOLD}"])
    return True
