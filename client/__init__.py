"""Producer side of replicadp: the producer API (api.py, submit.py, results.py) at the top, and rooms for the
HTTP front door (http/), operations tools (ops/), the local cluster (local/) and benchmarks (bench/)."""

from .api import ClientError, Outcome, cancel_request, fetch_video, live_replicas, preempt_request, run_requests

__all__ = ["ClientError", "Outcome", "cancel_request", "fetch_video", "live_replicas", "preempt_request",
           "run_requests"]
