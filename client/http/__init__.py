"""The HTTP front door (`replicadp serve-http`): vllm-omni's video API in front of the replicas, as a FastAPI
app. Each HTTP request becomes exactly one `generate` task on its model's queue; the gateway holds no model and
no GPU (it never imports torch). See docs/http.md.
"""

from .app import create_app

__all__ = ["create_app"]
