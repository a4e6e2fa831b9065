"""The Celery app: `celery -A replicadp_tasks worker` finds it here."""

import time

from celery import Celery, signals

app = Celery("replicadp")
app.config_from_object("celeryconfig")


@signals.before_task_publish.connect
def _stamp(sender=None, headers=None, **_):
    """Record when a request was sent, so that its result can report how long it queued. Leave its time
    limits to the replica: Celery would otherwise send the producer's own settings, which win over the
    worker's."""
    if sender == "replicadp.generate" and headers is not None:
        headers.setdefault("replicadp_sent_at", time.time())
        headers["timelimit"] = [None, None]
