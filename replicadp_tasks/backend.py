"""Celery's Sentinel result backend, on connections that leave a server that stopped being the master.

celery_backend_url (connection.py) names it for a Sentinel URL. Celery's own drops a connection on READONLY only,
so a result or progress write on a connection kept from before a failover reached the resumed old master, which
refused it (NOREPLICAS), and failed the request; here the write goes to the new master instead.
"""

from celery.backends.redis import SentinelBackend as CelerySentinelBackend

from .connection import MasterConnection


class SentinelBackend(CelerySentinelBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.connparams.setdefault("connection_class", MasterConnection)  # TLS (rediss) sets a class of its own
