"""How a delivery leaves `generate` other than by returning its Result or raising a request's error (contract/errors.py), and why each way is the one Celery leaves.

Celery's task API has two endings: return (SUCCESS, stored and acknowledged by Celery) or raise (FAILURE, stored
and acknowledged). A replica needs four more:

- Finishing: the frames are computed, and the pool child's finisher thread will store, answer and acknowledge
  the request while the replica computes its next one (finisher.py). The task raises it: it is Celery's Ignore,
  for which Celery stores no state and, with a custom Request class, lets the main process keep the message
  (worker.ReplicaRequest.on_failure hands it to leases.Keeper.finishing). A return would store SUCCESS at once.
- Parked: another live delivery computes this request_id. Ignore again; the main process parks the message on
  that request's fence (leases.Keeper.park), for the sweep to requeue once the fence is free.
- Preempted: stopped at a step boundary for a request of a higher priority, its state saved (delivery.py). Ignore
  again; the main process puts its message back at the head of its priority list at once (leases.Keeper.requeue),
  as for a request whose pool child was lost, and the replica takes the next one.
- exit_process: the pool child ends without acknowledging or failing its message, so that the main process
  requeues it (task_reject_on_worker_lost, leases.Keeper.lost): a fence lost to another delivery (an
  acknowledgement would acknowledge the delivery tag the other delivery shares), a broken group of ranks, an
  answer that cannot be written. In Celery's prefork pool only a pool child that dies gets its message requeued;
  os._exit, with a status (Exit) that the main process's log shows, skips Celery's own handling in the child.
"""

from __future__ import annotations

import logging
import os
from enum import IntEnum
from typing import NoReturn

from celery.exceptions import Ignore

from ..contract.errors import ReplicaDPError

log = logging.getLogger("replicadp")


class Parked(ReplicaDPError, Ignore):
    """Raised when a delivery finds its request_id being computed by another live delivery (the fence is taken).

    Fails nothing: Celery stores no state for it, and the replica's main process parks its message in Redis
    (leases.Keeper.park) instead of acknowledging it; the lease sweep puts it back in the queue once that fence is
    gone, and that delivery then returns the stored result, or computes it if none was stored.
    """


class Finishing(ReplicaDPError, Ignore):
    """Raised when a request's frames are computed and its pool child's finisher thread encodes, stores and
    answers it (finisher.py), so that the replica computes its next request meanwhile.

    Fails nothing: Celery stores no state for it; the replica's main process keeps its message unacknowledged in
    Redis, as its own, and takes the next one (leases.Keeper.finishing). The finisher writes the result (or the
    failure), then acknowledges the message; if the pool child dies first, the message goes back to the queue.
    """


class Preempted(ReplicaDPError, Ignore):
    """Raised when a running request was stopped at a step boundary for one of a higher priority (RequestPreempted)
    and its state saved.

    Fails nothing: Celery stores no state for it; the replica's main process requeues its message at the head of
    its priority list (leases.Keeper.requeue), and whichever replica takes it goes on from the saved step.
    """


class Exit(IntEnum):
    """The exit status of a pool child that ends so that its request is requeued; and of a replica that cannot
    load its model (or its store), which restarting would not mend."""

    FENCED_OUT = 75  # its delivery lost the request's fence to another (EX_TEMPFAIL)
    GROUP_LOST = 76  # its multi-process group of ranks broke (errors.GroupLost)
    UNANSWERED = 77  # its finisher could not write a request's answer
    CONFIG = 78  # the replica cannot load what it is configured to serve (EX_CONFIG): worker.py, worker_launch.sh


def exit_process(status: Exit, why: str) -> NoReturn:
    """End this pool child now, saying why: its main process requeues the request it held (see above)."""
    log.error("%s; the pool child exits (status %d), its request is requeued", why, status)
    os._exit(status)
