"""The `generate` task: one request, from its message to its frames, which the finisher thread then encodes,
stores and answers (replica/delivery.py says how a delivery of it goes, replica/outcomes.py how it may end).

`generate` runs in a replica's pool child, over `child.current()` (the resident pipeline, the store, Redis).
"""

from __future__ import annotations

import time

from .app import app
from .contract.records import Result
from .contract.webhook import Event
from .replica import child
from .replica.delivery import Delivery


@app.task(name="replicadp.generate", bind=True, Request="replicadp_tasks.worker:ReplicaRequest")
def generate(self, prompt=None, **kwargs) -> Result:
    """Generate one video: compute its frames, then hand them to the finisher thread, which encodes, stores and
    answers it (outcomes.Finishing). A request answered here returns its Result (stored before) or raises (refused,
    cancelled, poison)."""
    started, me, kwargs = time.time(), child.current(), {"prompt": prompt, **kwargs}
    # 1. Can this replica's ranks serve it? An earlier request that ran out of memory on one of them left them
    #    apart: the pool child ends before this request is counted; it is requeued and the next child rebuilds.
    me.check_group(self.request.id)
    # 2. Say that this replica took it (STARTED), count the attempt (each earlier one ended its replica's
    #    process); cancelled before it started, or poison? Its records are written before Celery's answer.
    with me.reporting(self.request):
        saved = me.start_attempt(self.request.id, kwargs)  # and where a preemption stopped it, if one did
        # 3. Validate it for the loaded model, check its webhook, fetch its first frame.
        delivery = Delivery.of(self, kwargs, started)
        # 4. Take its fence, unless a delivery of this request_id has stored its result: then that is the answer;
        #    or, if another live delivery holds the fence, it is parked (outcomes.Parked).
        earlier = delivery.take_fence()
        if earlier is not None:
            delivery.tell(Event.COMPLETED, result=earlier)
            return earlier
        # 5. Run the pipeline: the frames.
        frames = delivery.compute(saved)
        # 6. Encode, store and answer it in the finisher thread; meanwhile this replica takes its next request.
        raise delivery.hand_to_finisher(frames)
