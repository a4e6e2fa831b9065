"""Asking that a running request be preempted (issue #58): the ask a replica's step reads (replica/delivery.py),
written by `replicadp preempt` (client.api.preempt_request) and by the replicas' preemption policy
(replica/preemption.py)."""

from __future__ import annotations

import redis

from ..contract.keys import CANCEL_CHANNEL, PREEMPT_KEY

# An ask of a request that is not running (it ended, or has not started) lapses after this long.
ASK_S = 60


def ask(client: redis.Redis, task_id: str, at_step: int = 1) -> None:
    """Ask that request `task_id` be preempted at its next step from `at_step` on; the replica running it hears it
    at once (replica/fences.FenceKeeper, on CANCEL_CHANNEL)."""
    pipe = client.pipeline(transaction=False)
    pipe.set(PREEMPT_KEY + task_id, at_step, ex=ASK_S)
    pipe.publish(CANCEL_CHANNEL, task_id)
    pipe.execute()
