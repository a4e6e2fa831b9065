"""The pool child's writer of progress records: a request's Progress (its phase and step, delivery.Delivery.report)
is written from a thread, so that the request does not wait on Redis for it (each is a round trip, fsynced with
`appendfsync always`: four or more a request, at each change of phase). Records are written in the order given,
each once; `flush()` waits for those put before it, and a request's answer is written only after a flush (the
task's, before Celery writes it; the finisher's, before it writes it), so that no progress record lands after
the request's result (broker/backend.py never lets a record replace a success, but it would replace a failure).
"""

from __future__ import annotations

import logging
import queue
import threading

log = logging.getLogger("replicadp")


class Reporter:
    def __init__(self, backend):
        self.backend = backend  # Celery's result backend (backend.py): a record is a state of the request's result
        self.records: queue.Queue = queue.Queue()

    def put(self, task_id: str, state: str, meta: dict, request) -> None:
        """Write `meta` as the state of `task_id`'s result, soon. `request`: the task's Celery request context
        (thread-local in Celery: this thread has none of its own)."""
        self.records.put((task_id, state, meta, request))

    def flush(self) -> None:
        """Wait until every record put before this call has been written (or has failed to be); not for those
        that other threads put meanwhile."""
        written = threading.Event()
        self.records.put(written)
        written.wait()

    def run(self) -> None:
        while True:
            record = self.records.get()
            if isinstance(record, threading.Event):  # a flush: everything before it is written
                record.set()
                continue
            task_id, state, meta, request = record
            try:
                self.backend.store_result(task_id, meta, state, request=request)
            except Exception as exc:  # a progress record is news, not a result: the request goes on without it
                log.warning("request %s: cannot write its progress (%s): %s", task_id, meta.get("phase"), exc)
