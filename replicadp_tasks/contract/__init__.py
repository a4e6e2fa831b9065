"""The contract: what producers (Python, the CLI, the HTTP gateway) and replicas agree on. A request's fields,
defaults and validation (request.py), the model it runs on and that model's queue (models.py), where it waits
(scheduling.py), its webhook (webhook.py), the records it leaves in Redis (records.py) under their keys (keys.py),
and the errors (errors.py). Imports no Celery, no Redis and no settings: a deployment's limits come in as
arguments."""

from . import keys
from .errors import (FetchError, GroupLost, ImageInputError, InvalidRequest, MessageRefused, ModelLoadError,
                     OutOfMemory, PoisonRequest, RedisURLError, ReplicaDPError, RequestCancelled, RequestIdConflict,
                     RequestPreempted, StoreError)
from .models import check_model_name, check_served, choose_model, queue_for
from .recipe import Recipe, Scheduler, parse_recipe, read_recipe
from .records import READY, Phase, Progress, ReplicaInfo, RequestState, Result
from .request import (DEFAULTS, FIELDS, MAX_FPS, MAX_FRAMES, MAX_STEPS, REFERENCE_SIZE, REFERENCE_WORK,
                      ROUTING_FIELDS, SCHEDULING_FIELDS, WEBHOOK_FIELDS, Accepts, GenerateRequest, Quality,
                      decode_json, input_key, parse_size, repeated_key, split_refusal, validate_request)
from .scheduling import TENANT_RE, Priority, Scheduling, check_priority, check_tenant, check_user, queue_lists
from .webhook import Event, Webhook, tenant_secret

__all__ = ["DEFAULTS", "FIELDS", "MAX_FPS", "MAX_FRAMES", "MAX_STEPS", "READY", "REFERENCE_SIZE", "REFERENCE_WORK",
           "ROUTING_FIELDS", "SCHEDULING_FIELDS", "TENANT_RE", "WEBHOOK_FIELDS", "Accepts", "Event", "FetchError",
           "GenerateRequest", "GroupLost", "ImageInputError", "InvalidRequest", "MessageRefused", "ModelLoadError",
           "OutOfMemory", "Phase", "PoisonRequest", "Priority", "Progress", "Quality", "RedisURLError", "Recipe",
           "ReplicaDPError", "ReplicaInfo", "RequestCancelled", "RequestIdConflict", "RequestPreempted",
           "RequestState", "Result", "Scheduler", "Scheduling", "StoreError", "Webhook", "check_model_name",
           "check_priority", "check_served",
           "check_tenant", "check_user", "choose_model", "decode_json", "input_key", "keys", "parse_recipe",
           "parse_size", "queue_for", "queue_lists", "read_recipe", "repeated_key", "split_refusal", "tenant_secret",
           "validate_request"]
