"""Every Celery setting replicadp uses, each with the reason for it. Values come from
replicadp_tasks.settings, which reads the environment once at start-up."""

from replicadp_tasks.broker import transport_for as _transport_for
from replicadp_tasks.cluster.connection import (CONNECT_TIMEOUT_S as _CONNECT_TIMEOUT_S,
                                                REPLY_TIMEOUT_S as _REPLY_TIMEOUT_S,
                                                celery_backend_url as _celery_backend_url,
                                                celery_options as _celery_options, celery_url as _celery_url)
from replicadp_tasks.contract.scheduling import LEVELS as _LEVELS
from replicadp_tasks.settings import SETTINGS as _S

# How often kombu checks the broker's long-lived connections (BRPOP, pub/sub), and redis-py PINGs a connection idle
# this long before using it.
_BROKER_HEALTH_CHECK_S = 5
# One Redis serves as broker and result backend; REDIS_URL (or `replicadp up`'s state) names it.
# The URL as given, for replicadp's own clients (client.api.redis_url). A Sentinel URL reaches Celery without
# our query parameters; the master's name goes in the transport options.
replicadp_redis_url = _S.redis_url
broker_url = _celery_url(_S.redis_url)
result_backend = _celery_backend_url(_S.redis_url)
result_backend_transport_options = _celery_options(_S.redis_url)
# kombu's Redis transport (or its Sentinel one) with a check of every request message before Celery reads it (a
# malformed one crashed the main process of every replica in turn); other transports go without.
broker_transport = _transport_for(_S.redis_url)

# A replica's life cycle (its signal handlers and lease bootstep): imported by `celery worker` before it starts,
# never by a producer.
imports = ("replicadp_tasks.worker",)

# JSON only: a pickled message on the queue would be code execution on a GPU host.
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

# Each request goes to its model's queue, which that model's replicas pull from (broker/routing.py); nothing is
# sent to the default queue.
task_routes = ("replicadp_tasks.broker.routing.route",)
task_default_queue = _S.queue

# One request at a time per replica (one GPU); prefork, not solo, so heartbeats, control commands,
# time limits and requeue on shutdown keep working while a request runs.
worker_pool = "prefork"
worker_concurrency = 1
# Reserve no request beyond the one running: a replica never sits on work another idle replica could do.
worker_prefetch_multiplier = 1
# Acknowledge after the request ends, so a request whose replica dies goes back to the queue.
task_acks_late = True
# A pool child killed mid-request (OOM, CUDA crash) requeues its request instead of failing it.
task_reject_on_worker_lost = True
# STARTED tells a client that its request left the queue and which replica took it. The task writes it (tasks.py),
# from its pool child's reporter thread: Celery's own write would be a round trip before the request starts.
task_track_started = False
# Task events feed Flower; the sent event lets it show queued requests too.
worker_send_task_events = True
task_send_sent_event = True
# Storing a result or a progress report waits out a Redis outage (up to REPLICADP_REDIS_OUTAGE) instead of
# failing a finished request.
result_backend_always_retry = True
result_backend_max_retries = _S.redis_outage_s
result_backend_max_sleep_between_retries_ms = 1000
# Results hold metadata only, so keeping them a day costs little.
result_expires = _S.result_ttl_s

# Soft limit: the request fails with SoftTimeLimitExceeded; hard limit: the child is replaced.
task_soft_time_limit = _S.soft_time_limit_s
task_time_limit = _S.time_limit_s
# Redis redelivers an unacknowledged message after visibility_timeout: keep it above the hard limit,
# or a long request runs twice.
# One list per replicadp priority (contract/scheduling.py), read in that order; kombu's default has a fourth.
# A server that stops answering (a frozen primary: its connections stay open) is left after the replies' timeout,
# for the master Sentinel names: a publish (a worker's event) would wait on it for good, and the event loop with
# it; a BRPOP with no reply past its 1 s and the health check's interval is dropped (kombu's default: 25 s).
broker_transport_options = {"visibility_timeout": _S.time_limit_s + 300, "priority_steps": _LEVELS,
                            "socket_timeout": _REPLY_TIMEOUT_S, "socket_connect_timeout": _CONNECT_TIMEOUT_S,
                            "health_check_interval": _BROKER_HEALTH_CHECK_S, **_celery_options(_S.redis_url)}
# Sending a request rides out a Redis restart (~30 s of retries) instead of failing the caller.
task_publish_retry_policy = {"max_retries": 30, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}
# An unreachable Redis is a clear error within seconds, not a hang; a frozen one too (the result backend's client,
# which the replicas write results with and the clients read them: Celery's default waits 120 s).
redis_socket_connect_timeout = _CONNECT_TIMEOUT_S
redis_socket_timeout = _REPLY_TIMEOUT_S
broker_connection_timeout = _CONNECT_TIMEOUT_S
# A replacement pool child loads the model before it reports UP; give it the time a real model needs.
worker_proc_alive_timeout = _S.load_timeout_s
# Replicas come up before or after Redis; keep retrying instead of exiting.
broker_connection_retry_on_startup = True
# A request running when the broker connection drops keeps running; its result is keyed by request_id,
# so a redelivery returns the stored result instead of computing a second one.
worker_cancel_long_running_tasks_on_connection_loss = False
# Celery's task logger names the request as well as the task (logs.Context gives every line its request_id).
worker_task_log_format = ("[%(asctime)s: %(levelname)s/%(processName)s] %(task_name)s[%(task_id)s] "
                          "request %(request_id)s: %(message)s")
