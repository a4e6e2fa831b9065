"""The `replicadp` command (pyproject's `replicadp = "client.cli:main"`): the click group `main`, and the options,
callbacks and exit statuses its commands share (options.py), which benches and tests use too.

One module per family of commands, each registering its commands on `main` (group.py) when imported here:
requests.py (generate, get, cancel, submit, webhook-secret), cluster.py (up, down, status), bench.py (bench, demo,
sweep), models.py (describe-model, calibrate-mag, make-tiny-model, make-tiny-lora), serve.py (serve-http, flower,
metrics, health) and settings.py (settings). Each command imports what it runs (torch, diffusers, the gateway)
when it runs, so that `replicadp --help` starts in a fraction of a second."""

from . import bench, cluster, models, requests, serve, settings  # noqa: F401  (they register their commands)
from .group import main  # noqa: F401  (they register their commands)
from .options import (OPTION_OF, PEAKS, Exit, Group, PortInUse, Unavailable, check_listen, image_param, json_to,
                      layout_param, lora_param, redis_url_option, size_param, user_param, write_json)  # noqa: F401  (they register their commands)

__all__ = ["OPTION_OF", "PEAKS", "Exit", "Group", "PortInUse", "Unavailable", "check_listen", "image_param",
           "json_to", "layout_param", "lora_param", "main", "redis_url_option", "size_param", "user_param",
           "write_json"]
