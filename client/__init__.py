"""Producer side of replicadp: submit requests, gather results, bench, check isolation."""

from .api import ClientError, Outcome, fetch_video, live_replicas, run_requests

__all__ = ["ClientError", "Outcome", "fetch_video", "live_replicas", "run_requests"]
