"""The pool child's finisher: a thread that ends one request (its encode, store and result, delivery.Delivery.finish)
while the pipeline computes the next. A GPU would otherwise sit idle through its replica's encode: hundreds of
milliseconds at 832x480, where a few-step request computes in one or two seconds (docs/benchmarks.md, section 15).

It starts a request's finish once the pipeline has begun computing the next one, or REPLICADP_FINISHER_WAIT_MS
after it was handed the frames if no next one has begun by then (the queue was empty, or the next request was
answered without computing): the hand-over of the next request (Celery's, the pop, its fence) then runs alone, not
beside an encode that takes the cores and the GIL from it, while the finish still has the whole compute to run in
(docs/benchmarks.md, section 15). On a GPU replica it also runs below the process's priority
(REPLICADP_FINISHER_NICE): where replicas share too few cores, other replicas' hand-overs run before this encode.

One request at a time: `submit` waits until the previous one is finished, so a replica holds at most the request
it computes and the one it finishes, and at most two requests' frames are in memory (the one being finished, and
the next one's, computed, waiting for it).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable

from .. import logs

log = logging.getLogger("replicadp")


class Finisher:
    def __init__(self, app, hostname: str, nice: int, wait_s: float):
        self.jobs: queue.Queue = queue.Queue()
        self.app, self.hostname = app, hostname  # the Celery app and the replica's name, for its task events
        self.nice = nice  # added to the thread's nice value (x264's threads inherit it): settings.finisher_nice
        self.wait_s = wait_s  # the longest a finish waits for the next request's compute: settings.finisher_wait_ms
        self.computing = threading.Event()  # set when the pipeline begins a request's compute after the last submit
        self.dispatcher = None  # Celery's event dispatcher, made in this thread when its first event is sent

    def submit(self, job: Callable[[], None], task_id: str, request_id: str) -> None:
        """Run `job`, the finish of request `task_id` (`request_id`), in the finisher's thread, once the one before
        it is done."""
        self.jobs.join()
        self.computing.clear()
        self.jobs.put((job, task_id, request_id))

    def computes(self) -> None:
        """From the pipeline's thread, as it begins computing a request: the finish waiting for it may start."""
        self.computing.set()

    def drain(self) -> None:
        """Finish the request waiting here, if any, now (no next request will be computed), and wait until it is."""
        self.computing.set()
        self.jobs.join()

    def send_event(self, kind: str, **fields) -> None:
        """From the finisher's thread: send a task event (`task-succeeded`, `task-failed`) as the replica's main
        process sends the others, for Flower and `replicadp metrics`; one that cannot be sent is logged."""
        if not self.app.conf.worker_send_task_events:
            return
        try:
            if self.dispatcher is None:
                self.dispatcher = self.app.events.Dispatcher(self.app.connection_for_write(), hostname=self.hostname)
            self.dispatcher.send(kind, **fields)
        except Exception as exc:  # news for a dashboard: the request's answer is written already
            log.warning("finisher: cannot send %s: %s", kind, exc)

    def run(self) -> None:
        if self.nice and sys.platform == "linux":  # Linux gives each thread a nice value; elsewhere this takes a pid
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.nice))
        while True:
            job, task_id, request_id = self.jobs.get()
            self.computing.wait(self.wait_s)  # the next request's hand-over first
            with logs.finishing(task_id, request_id):  # its lines name it, not the request the child computes
                try:
                    job()
                except Exception:  # a job answers its own request's failures: this is a bug, and the thread goes on
                    log.exception("finisher: a request's finish failed")
                finally:
                    self.jobs.task_done()
