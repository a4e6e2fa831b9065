"""A replica's processes beyond Celery's own: the pool child that runs `generate` (child.py), one delivery of a
request from its validation to its answer (delivery.py), the child's threads (fences.py: its fences and cancels;
reporter.py: its progress records; finisher.py: a request's encode, store and answer while the next computes),
the main process's leases (leases.py), and the ways a delivery ends other than returning or failing
(outcomes.py). worker.py connects them to Celery's signals."""

from . import child
from .delivery import Delivery
from .fences import FenceKeeper
from .finisher import Finisher
from .leases import Keeper
from .outcomes import Exit, Finishing, Parked, exit_process
from .reporter import Reporter

__all__ = ["Delivery", "Exit", "FenceKeeper", "Finisher", "Finishing", "Keeper", "Parked", "Reporter", "child",
           "exit_process"]
