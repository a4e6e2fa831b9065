"""The web page (`/ui`, docs/ui.md) and the one route only it needs, `GET /v1/status`: the live replicas, what each
runs, the queue and the expected wait. The page is static files (HTML, CSS, one JS file, no build step) served
without a key, as /docs is; everything it shows comes from /v1, with the key the user types in."""

from __future__ import annotations

import asyncio
import json
from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse

from replicadp_tasks.keys import JOB_KEY, JOBS_KEY, REPLICA_KEY
from replicadp_tasks.records import RequestState
from replicadp_tasks.scheduling import Priority

from ..ops.status import snapshot
from .errors import ErrorCode, GatewayError
from .gateway import Refreshed
from .routes import GatewayDep, OwnerDep
from .schema import ERRORS, ClusterStatus, ReplicaStatus, RunningRequest

router = APIRouter()

STATIC = files("client.http") / "static"
ASSETS = {"ui.js": "text/javascript", "ui.css": "text/css"}  # what /ui/{name} serves besides the page
# The page fetches its videos into blob: URLs (with the key) and never loads anything from another origin.
PAGE_HEADERS = {"Cache-Control": "no-cache", "Content-Security-Policy": (
    "default-src 'self'; img-src 'self' blob: data:; media-src 'self' blob:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'")}
SNAPSHOT_CACHE_S = 1.0  # pages poll every second: they share one snapshot (a few Redis reads) at a time
MEAN_OVER_JOBS = 20  # the expected wait's mean request time: over this many of the latest jobs that completed


@router.get("/", include_in_schema=False)
async def root():
    return RedirectResponse("/ui")


@router.get("/ui/", include_in_schema=False)
async def slash():
    return RedirectResponse("/ui")  # a path, not a URL: nothing taken from the Host header


@router.get("/ui", include_in_schema=False)
async def page():
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/ui/{name}", include_in_schema=False)
async def asset(name: str):
    if name not in ASSETS:
        raise GatewayError(404, f"name={name!r}: the page has no such file", code=ErrorCode.NOT_FOUND, param="name")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers=PAGE_HEADERS)


def snapshots(request: Request) -> Refreshed:
    """`replicadp status`'s snapshot (client/ops/status.py), taken in a thread and shared by every polling page
    while SNAPSHOT_CACHE_S fresh: any number of pages cost one snapshot at a time."""
    state = request.app.state
    if not hasattr(state, "snapshots"):
        state.snapshots = Refreshed(lambda: asyncio.to_thread(snapshot), SNAPSHOT_CACHE_S)
    return state.snapshots


async def mean_request_s(gw) -> float | None:
    """The mean time on a replica (the Result's timings.total_s) of the latest MEAN_OVER_JOBS completed jobs
    among the latest jobs of every gateway on this Redis; None when none of them completed."""
    ids = [i.decode() for i in await gw.redis.zrevrange(JOBS_KEY, 0, 2 * MEAN_OVER_JOBS - 1)]
    times = [meta["result"]["timings"]["total_s"] for _, meta in await gw.job_records(ids)
             if meta and meta["status"] == RequestState.SUCCESS][:MEAN_OVER_JOBS]
    return sum(times) / len(times) if times else None


def expected_wait_s(replicas: list[ReplicaStatus], queued: dict[Priority, int], mean: float | None
                    ) -> dict[str, float | None]:
    """Per priority, seconds until a request queued now at it starts: 0 while a serving replica is idle for it;
    else the work ahead of it (the requests queued at its priority and above, plus what the running ones have
    left, by their steps) in units of `mean`, shared by the serving replicas. None when unknown: no serving
    replica, or no mean."""
    serving = [r for r in replicas if r.serving]
    idle = sum(r.running is None for r in serving)
    left = sum(1 - (r.running.step or 0) / r.running.total_steps if r.running.total_steps else 1
               for r in serving if r.running is not None)
    waits, ahead = {}, 0
    for priority, n in queued.items():  # highest first: a request waits behind its own priority and those above
        ahead += n
        if serving and ahead < idle:
            waits[str(priority)] = 0.0
        elif serving and mean is not None:
            waits[str(priority)] = round((ahead - idle + left) * mean / len(serving), 1)
        else:
            waits[str(priority)] = None
    return waits


@router.get("/v1/status", response_model=ClusterStatus, responses=ERRORS)
async def status(request: Request, gw: GatewayDep, owner: OwnerDep):
    """The live replicas (what each serves, and runs at which step), the queue per priority and the expected wait
    of a request queued now; what the web page polls (docs/ui.md). A running request is named, with its step,
    only to its own owner (the caller's API key; without one, keyless jobs): anyone else sees the replica busy."""
    snap = await snapshots(request).get()
    names = [r["name"] for r in snap["replicas"]]
    raws = await gw.redis.mget([REPLICA_KEY + n for n in names]) if names else []
    ids = [r["request_id"] for r in snap["replicas"] if r["request_id"]]
    jobs = dict(zip(ids, await gw.redis.mget([JOB_KEY + i for i in ids]))) if ids else {}
    mine = {i for i, job in jobs.items() if job and json.loads(job).get("owner") == owner}
    replicas = []
    for seen, raw in zip(snap["replicas"], raws):
        info = json.loads(raw) if raw else {}
        running = None
        if seen["request_id"] in mine:
            running = RunningRequest(id=seen["request_id"], step=seen["step"], total_steps=seen["total_steps"])
        elif seen["request_id"]:
            running = RunningRequest(id=None, step=None, total_steps=None)
        qualities = info.get("qualities")
        replicas.append(ReplicaStatus(
            name=seen["name"], device=info.get("device"), model=info.get("model"),
            accepts_image=bool(info.get("accepts_image")), size_multiple=info.get("size_multiple"),
            qualities=[str(q) for q in qualities] if isinstance(qualities, list) else None,
            loras=[a["name"] for a in info.get("loras") or []], serving=seen["serving"], running=running))
    queued = await gw.queue_by_priority()
    mean = await mean_request_s(gw)
    return ClusterStatus(replicas=replicas, queue_depth=sum(queued.values()),
                         queue_by_priority={str(p): n for p, n in queued.items()}, mean_request_s=mean,
                         expected_wait_s=expected_wait_s(replicas, queued, mean))
