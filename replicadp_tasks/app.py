"""The Celery app: `celery -A replicadp_tasks worker` finds it here."""

import time

from celery import Celery, signals

app = Celery("replicadp")
app.config_from_object("celeryconfig")


@signals.before_task_publish.connect
def _stamp(sender=None, headers=None, body=None, **_):
    """Record when a request was sent, so that its result can report how long it queued, and its priority and
    user, for the transport to place it by (scheduling.py). Leave its time limits to the replica: Celery would
    otherwise send the producer's own settings, which win over the worker's."""
    if sender == "replicadp.generate" and headers is not None:
        headers.setdefault("replicadp_sent_at", time.time())
        headers["timelimit"] = [None, None]
        kwargs = body[1] if isinstance(body, (list, tuple)) and len(body) == 3 and isinstance(body[1], dict) else {}
        for field in ("priority", "user"):
            if kwargs.get(field) is not None:
                headers[f"replicadp_{field}"] = kwargs[field]
