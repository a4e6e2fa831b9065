"""What this deployment allows a request's webhook: webhooks on (REPLICADP_WEBHOOKS), a secret to sign its
events with (REPLICADP_WEBHOOK_SECRET), and an address an image URL could have (inputs/fetch.py: public, or in
REPLICADP_FETCH_ALLOW). The webhook's form is the contract's (contract/webhook.py)."""

from __future__ import annotations

from ..contract.errors import InvalidRequest
from ..contract.webhook import Webhook
from ..inputs import fetch
from ..settings import SETTINGS


def available() -> bool:
    """Whether this process may queue webhook events: switched on, and a secret to sign them with."""
    return SETTINGS.webhooks and bool(SETTINGS.webhook_secret)


def check_allowed(webhook: Webhook | None) -> None:
    """Raise InvalidRequest naming `webhook` if this deployment does not allow it: webhooks off, no secret, or a
    host with an address that is not public and not in REPLICADP_FETCH_ALLOW (a DNS lookup)."""
    if webhook is None:
        return
    url = webhook.url
    if not SETTINGS.webhooks:
        raise InvalidRequest.of("webhook", "webhooks are switched off here (REPLICADP_WEBHOOKS=0)", value=url)
    if not SETTINGS.webhook_secret:
        raise InvalidRequest.of("webhook", "webhooks are not set up here: they are signed, and "
                                           "REPLICADP_WEBHOOK_SECRET is not set", value=url)
    fetch.target(url, SETTINGS.fetch_allow, lambda why: InvalidRequest.of("webhook", why, value=url))
