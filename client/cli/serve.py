"""Long-running servers beside the replicas, and the healthcheck: `serve-http` (the HTTP gateway), `flower` (Celery's
dashboard), `metrics` (the Prometheus exporter) and `health` (one replica's verdict, for docker-compose)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..api import ClientError, check_redis
from ..ops.health import REPLY_TIMEOUT_S as HEALTH_REPLY_TIMEOUT_S, STALL_S as HEALTH_STALL_S
from ..progress import console
from .group import main
from .options import check_listen, redis_url_option


@main.command("serve-http")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8098, show_default=True)
@click.option("--max-queue", default=64, show_default=True, envvar="REPLICADP_HTTP_MAX_QUEUE",
              help="Requests waiting in the queue past which new ones get 429 (env REPLICADP_HTTP_MAX_QUEUE).")
@click.option("--sync-timeout", default=1800.0, show_default=True, envvar="REPLICADP_HTTP_SYNC_TIMEOUT",
              help="Seconds a /v1/videos/sync request waits before a 504 (env REPLICADP_HTTP_SYNC_TIMEOUT).")
@click.option("--shutdown-grace", default=10.0, show_default=True, type=click.FloatRange(min=0),
              envvar="REPLICADP_HTTP_SHUTDOWN_GRACE",
              help="Seconds a graceful stop (SIGTERM) waits for /v1/videos/sync requests in flight; those still "
                   "waiting then get a 503 with their job id and go on running (env REPLICADP_HTTP_SHUTDOWN_GRACE).")
@click.option("--api-key", "api_keys", multiple=True, envvar="REPLICADP_API_KEYS", metavar="KEY",
              help="A bearer token /v1 accepts; repeat for several (env REPLICADP_API_KEYS, space-separated). "
                   "Without keys the API is open.")
@click.option("--api-keys-file", "key_files", multiple=True, envvar="REPLICADP_API_KEYS_FILE",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A file of API keys, one per line, # comments (env REPLICADP_API_KEYS_FILE).")
@click.option("--allowed-hosts", "hosts", multiple=True, envvar="REPLICADP_ALLOWED_HOSTS", metavar="NAME",
              help="A Host name the gateway answers, any port; repeat for several, '*' for any (env "
                   "REPLICADP_ALLOWED_HOSTS, space-separated). Default: localhost, 127.0.0.1 and [::1] when --host "
                   "is loopback, any otherwise. Others get 400 (a DNS-rebound name); /health answers every name.")
@click.option("--docs/--no-docs", default=False, show_default=True, envvar="REPLICADP_HTTP_DOCS",
              help="Serve FastAPI's interactive /docs and /redoc, which load their scripts from a CDN "
                   "(env REPLICADP_HTTP_DOCS). /openapi.json is served either way.")
@click.option("--max-connections", type=click.IntRange(min=1), envvar="REPLICADP_HTTP_MAX_CONNECTIONS",
              help="Open connections past which a request gets 503 at once, /health too (env "
                   "REPLICADP_HTTP_MAX_CONNECTIONS). Default: the open-file limit (ulimit -n) less 128.")
@click.option("--header-timeout", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              envvar="REPLICADP_HTTP_HEADER_TIMEOUT",
              help="Seconds a connection has to send a request's headers, from its opening or its last answer, "
                   "before it is closed (env REPLICADP_HTTP_HEADER_TIMEOUT).")
@click.option("--keep-alive", default=5, show_default=True, type=click.IntRange(min=1),
              envvar="REPLICADP_HTTP_KEEP_ALIVE",
              help="Seconds an idle keep-alive connection stays open (env REPLICADP_HTTP_KEEP_ALIVE).")
@redis_url_option()
def serve_http(host, port, max_queue, sync_timeout, shutdown_grace, api_keys, key_files, hosts, docs,
               max_connections, header_timeout, keep_alive):
    """HTTP front door: vllm-omni's video API (/v1/videos, /v1/videos/sync) in front of the replicas."""
    import logging.config

    from replicadp_tasks.logs import uvicorn_config
    from replicadp_tasks.settings import SETTINGS

    from ..http import create_app
    from ..http.app import serve
    from ..http.auth import ApiKeyError, read_keys
    from ..http.guard import allowed_hosts

    try:
        keys = read_keys(api_keys, key_files)
    except ApiKeyError as exc:
        raise click.BadParameter(str(exc), param_hint="--api-key / --api-keys-file")
    check_listen(host, port)
    check_redis()
    log_config = uvicorn_config(SETTINGS.log_format)
    logging.config.dictConfig(log_config)  # before uvicorn does: these lines are in the gateway's format too
    log = logging.getLogger("uvicorn.error")
    if keys:
        log.info("API keys: %d, of %d tenants; /v1 answers 401 without one of them", len(keys),
                 len({key.owner for key in keys}))
    elif host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no API keys: anyone who reaches %s:%d can create, list and delete jobs (--api-key, "
                    "REPLICADP_API_KEYS)", host, port)
    shown = f"[{host}]" if ":" in host else host
    log.info("web page: http://%s:%d/ui (docs/ui.md)", shown, port)
    api = create_app(max_queue=max_queue, sync_timeout=sync_timeout, api_keys=keys,
                     allowed_hosts=allowed_hosts(hosts, host), docs=docs)
    serve(api, host=host, port=port, grace=shutdown_grace, log_config=log_config, max_connections=max_connections,
          header_timeout=header_timeout, keep_alive=keep_alive)


@main.command()
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 only in a container whose port is published on loopback).")
@click.option("--port", default=5555, show_default=True)
@redis_url_option()
def flower(address, port):
    """Flower, the Celery dashboard (replicas, requests), behind basic auth: FLOWER_BASIC_AUTH=user:password,
    else a generated password, printed once."""
    from ..ops.flower import CredentialsError, credentials, exec_flower

    try:
        auth, generated = credentials(os.environ)
    except CredentialsError as exc:
        raise click.ClickException(str(exc))
    check_redis()
    if generated:
        console.print(f"Flower basic auth (generated, shown once): {auth}")
    console.print(f"Flower on http://{address}:{port}/")
    exec_flower(address, port, auth)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 only in a container whose port is published on loopback).")
@click.option("--port", default=9808, show_default=True)
@redis_url_option()
def metrics(host, port):
    """Prometheus exporter: queue depth and wait, replica busy/idle, requests completed and failed, latency and
    queue-wait histograms."""
    from ..ops.metrics import serve

    check_redis()
    console.print(f"metrics on http://{host}:{port}/metrics")
    try:
        serve(host, port)
    except OSError as exc:
        raise click.ClickException(f"--host {host} --port {port}: {exc}")


@main.command()
@click.option("--replica", required=True, help="Node name, e.g. replica0@%h (%h: this host, as in `celery worker -n`).")
@click.option("--stall-after", default=HEALTH_STALL_S, show_default=True,
              help="Seconds without progress (same step, or idle beside a waiting request) that are unhealthy.")
@click.option("--timeout", default=HEALTH_REPLY_TIMEOUT_S, show_default=True, help="Seconds to wait for each reply.")
@redis_url_option()
def health(replica, stall_after, timeout):
    """Exit 0 if the replica serves (answers, consumes the queue, makes progress), else 1; one line says why.
    For docker-compose's healthcheck."""
    from ..ops.health import check

    try:
        check_redis(timeout=timeout)
    except ClientError as exc:  # a healthcheck's verdict, not an error
        click.echo(f"unhealthy: {exc}")
        sys.exit(1)
    verdict = check(replica, stall_s=stall_after, timeout=timeout)
    click.echo(f"{'healthy' if verdict.healthy else 'unhealthy'}: {verdict.reason}")
    sys.exit(0 if verdict.healthy else 1)
