"""Celery's broker and result backend as replicadp uses them: the router that sends each request to its model's
queue (routing.py), kombu's Redis transport, which places each request
by its priority, tenant and user (transport.py, placement.py) and checks every message before Celery reads it
(message.py), and the result backend that writes a state in one round trip and keeps an answer across a failover
(backend.py). celeryconfig.py names these classes."""

from .placement import next_request, queue_order, queue_order_call, waiting
from .routing import ModelRouter, fleet
from .transport import transport_for

__all__ = ["ModelRouter", "fleet", "next_request", "queue_order", "queue_order_call", "transport_for", "waiting"]
