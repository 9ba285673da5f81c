"""Write-behind for a learner's uploads: phase p's delta and state go up while phase p+1 trains.

One worker thread keeps the order the storage contract needs (phase p's delta, then its state,
then phase p+1's). A failed upload is raised at the next submit or at `flush`, so the learner
fails loudly instead of training on with a hole in its deltas.

With a `limit`, at most that many jobs are queued or running: a submit past it waits for the
oldest to finish, so a learner whose store is slower than its training keeps one phase's delta
and state on their way up (limit 1), not a queue of them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class WriteBehind:
    def __init__(self, limit: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="write-behind")
        self._pending: list[Future] = []
        self.limit = limit

    def submit(self, job: Callable[[], None]) -> None:
        self._raise_failed(wait=False)
        while self.limit is not None and len(self._pending) >= self.limit:
            self._pending.pop(0).result()
        self._pending.append(self._pool.submit(job))

    def flush(self) -> None:
        """Wait for every upload submitted so far; raise the first that failed."""
        self._raise_failed(wait=True)

    def _raise_failed(self, wait: bool) -> None:
        done = [f for f in self._pending if wait or f.done()]
        self._pending = [f for f in self._pending if f not in done]
        for f in done:
            f.result()

    def close(self) -> None:
        self.flush()
        self._pool.shutdown()
