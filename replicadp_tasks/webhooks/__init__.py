"""Webhooks: a request that names a URL (`webhook`) is told of its events there (`webhook_events`: started,
progress, completed, failed; by default completed and failed), each a signed JSON POST.

The replica never waits on a receiver: the pool child only queues an event in Redis (durable across its own
death), and the senders, threads of every replica's main process, take the events that are due and POST them.
An event is delivered at least once: a sender that takes one makes it due again `claim_s` later
(REPLICADP_WEBHOOK_CLAIM, 60 s; its destination's send slot is held as long), so that if it dies
sending, another sender takes it; under normal operation an event is sent by one sender only, and each event id
is queued once (a redelivered request does not queue its events again). A receiver that answers 429 or 5xx, or
none at all, is tried again with exponential backoff, ATTEMPTS times in all (counted when taken, so neither a
sender's death nor a lost Redis reply adds one); any other answer is final. A progress event is tried once.

Tenants: a request sent with an API key carries its owner (`tenant`), and its events are signed with
tenant_secret(deployment secret, tenant), so that a tenant that verifies its own events cannot sign another's.
Destinations: at most PER_HOST_SENDS attempts in flight to one host:port across all senders (a host at its cap
is skipped, not waited on, so one tenant's dead receiver holds that many senders, never all), and a host whose
attempts fail is not tried for a while (HOST_BASE_DELAY_S doubling up to MAX_HOST_DELAY_S).

A webhook may reach only what an image URL may (inputs/fetch.py: public addresses, or REPLICADP_FETCH_ALLOW):
checked when the request is validated (policy.py), and again at each send, connecting only to an address just
checked (sender.py). What a webhook is on the wire (its fields, events, body and signature) is the contract's:
contract/webhook.py.
"""

from .events import MAX_EVENTS_PER_REQUEST, emit, emit_failure
from .policy import available, check_allowed
from .sender import ATTEMPTS, Sender, backoff

__all__ = ["ATTEMPTS", "MAX_EVENTS_PER_REQUEST", "Sender", "available", "backoff", "check_allowed", "emit",
           "emit_failure"]
