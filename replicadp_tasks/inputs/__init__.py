"""What a request brings in from outside: its first frame (images.py), fetched from a URL only under the fetch
policy (fetch.py: public addresses, or REPLICADP_FETCH_ALLOW), bounded and decoded before the model sees it."""

from . import fetch
from .images import load_first_frame

__all__ = ["fetch", "load_first_frame"]
