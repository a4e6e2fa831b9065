"""Celery's router for `generate` (celeryconfig's task_routes): each request to its model's queue.

Every producer that loads celeryconfig routes through it: `generate.delay`, the CLI and the gateway, and Celery's
own `celery call` and Flower's task API too. A request names its model or takes the deployment's default
(contract/models.py); one for a model the deployment does not serve raises InvalidRequest in the producer, before
anything is sent. An explicit `queue` option still wins (Celery's own rule), and a replica refuses a request that
names another model than its own.
"""

from __future__ import annotations

from celery import current_app

from ..cluster.fleet import Fleet
from ..contract.models import queue_for
from ..settings import SETTINGS

TASK = "replicadp.generate"
_FLEETS: dict[int, Fleet] = {}  # per Celery app (its backend's Redis): a test process has several


def fleet(app=None) -> Fleet:
    """This process's view of the deployment's models, on `app`'s Redis (default: Celery's current app)."""
    app = app or current_app
    known = _FLEETS.get(id(app))
    if known is None:
        known = _FLEETS[id(app)] = Fleet(app.backend.client, SETTINGS.models, SETTINGS.default_model)
    return known


class ModelRouter:
    """The router: {"queue": <the model's queue>} for a request, None (Celery's default) for any other task. On
    `app`'s Redis; None: the app of the task sent, else Celery's current one (an app that does not hold the
    task, one of client.api's for another Redis, names itself)."""

    def __init__(self, app=None):
        self.app = app

    def __call__(self, name, args, kwargs, options, task=None, **_):
        if name != TASK:
            return None
        model = fleet(self.app or getattr(task, "app", None)).choose((kwargs or {}).get("model"))
        return {"queue": queue_for(SETTINGS.queue, model)}


route = ModelRouter()
