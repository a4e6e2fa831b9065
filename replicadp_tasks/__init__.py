"""Worker side of replicadp: the Celery `app` and the `generate` task. A replica's life cycle (worker.py) is
imported by the worker alone (celeryconfig's `imports`), so that a producer importing this starts nothing."""

from .app import app
from .tasks import generate

__all__ = ["app", "generate"]
