"""Worker side of replicadp: the Celery `app` and the `generate` task."""

from .app import app
from . import worker  # noqa: F401  (connects the replica's life-cycle signals)
from .tasks import generate

__all__ = ["app", "generate"]
