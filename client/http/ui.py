"""The web page (`/ui`, docs/ui.md) and the one route only it needs, `GET /v1/status`: the live replicas, what each
runs, the queue and the expected wait. The pages are static files (HTML, CSS, JS, an SVG icon; no build step) served
without a key, as /docs is; everything it shows comes from /v1, with the key the user types in."""

from __future__ import annotations

import json
import time
from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse

from replicadp_tasks.contract import DEFAULTS as REQUEST_DEFAULTS, keys

from .errors import ErrorCode, GatewayError
from .jobs import job_view
from .routes import GatewayDep, OwnerDep
from .schema import ERRORS, ClusterStatus, ReplicaStatus, RunningRequest
from .waits import capacity, expected_wait_s, recents, snapshots

# What a request that leaves them out gets (validate.DEFAULTS), as the form's fields.
DEFAULTS = {"size": f"{REQUEST_DEFAULTS['width']}x{REQUEST_DEFAULTS['height']}",
            **{k: REQUEST_DEFAULTS[k] for k in ("num_frames", "num_inference_steps", "guidance_scale", "fps")}}

router = APIRouter()

STATIC = files("client.http") / "static"
# What /ui/{name} serves besides the pages (/ui: index.html, /ui/videos/{id}: video.html).
ASSETS = {"common.js": "text/javascript", "ui.js": "text/javascript", "video.js": "text/javascript",
          "ui.css": "text/css", "favicon.svg": "image/svg+xml"}
# The page fetches its videos into blob: URLs (with the key) and never loads anything from another origin.
PAGE_HEADERS = {"Cache-Control": "no-cache", "Content-Security-Policy": (
    "default-src 'self'; img-src 'self' blob: data:; media-src 'self' blob:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'")}


@router.get("/", include_in_schema=False)
async def root():
    return RedirectResponse("/ui")


@router.get("/ui/", include_in_schema=False)
async def slash():
    return RedirectResponse("/ui")  # a path, not a URL: nothing taken from the Host header


@router.get("/ui", include_in_schema=False)
async def page():
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/ui/videos/{video_id}", include_in_schema=False)
async def video_page(video_id: str):
    """A video's own page (bookmarkable): static, as /ui is; its script reads the id from the URL and asks /v1
    for the job, with the key the user gave."""
    return FileResponse(STATIC / "video.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/ui/{name}", include_in_schema=False)
async def asset(name: str):
    if name not in ASSETS:
        raise GatewayError(404, f"name={name!r}: the page has no such file", code=ErrorCode.NOT_FOUND, param="name")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers=PAGE_HEADERS)


@router.get("/favicon.ico", include_in_schema=False)
async def favicon():
    """What a browser asks for without a page's <link rel=icon> (a JSON response, say): the SVG icon, not a 404."""
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml", headers=PAGE_HEADERS)


@router.get("/v1/status", response_model=ClusterStatus, responses=ERRORS)
async def status(request: Request, gw: GatewayDep, owner: OwnerDep):
    """The live replicas (what each serves, and runs at which step), the queue per priority and the expected wait
    of a request queued now; what the web page polls (docs/ui.md). A running request is named, with its prompt,
    phase and step (from its job, as GET /v1/videos/{id} shows them), only to its own owner (the caller's API key;
    without one, keyless jobs): anyone else sees the replica busy. A request that has ended is not shown running,
    though the snapshot may still say so."""
    snap = await snapshots(request).get()
    names = [r["name"] for r in snap["replicas"]]
    raws = await gw.redis.mget([keys.REPLICA_KEY + n for n in names]) if names else []
    ids = [r["request_id"] for r in snap["replicas"] if r["request_id"]]
    now = time.time()
    mine = {record["id"]: job_view(record, meta, now) for record, meta in await gw.job_records(ids)
            if record.get("owner") == owner}
    replicas = []
    for seen, raw in zip(snap["replicas"], raws):
        info = json.loads(raw) if raw else {}
        job, running = mine.get(seen["request_id"]), None
        if job is not None:
            if job.status in ("queued", "in_progress"):
                running = RunningRequest(id=job.id, step=job.step, total_steps=job.total_steps, prompt=job.prompt,
                                         phase=job.phase)
        elif seen["request_id"]:
            running = RunningRequest(id=None, step=None, total_steps=None)
        qualities = info.get("qualities")
        replicas.append(ReplicaStatus(
            name=seen["name"], device=info.get("device"), model=info.get("model"),
            accepts_image=bool(info.get("accepts_image")), size_multiple=info.get("size_multiple"),
            qualities=[str(q) for q in qualities] if isinstance(qualities, list) else None,
            loras=[a["name"] for a in info.get("loras") or []], serving=seen["serving"], running=running))
    queued = await gw.queue_by_priority()
    cost = await recents(request).get()
    return ClusterStatus(replicas=replicas, queue_depth=sum(queued.values()),
                         queue_by_priority={str(p): n for p, n in queued.items()}, mean_request_s=cost.mean_request_s,
                         expected_wait_s=expected_wait_s(capacity(snap), queued, cost.mean_request_s),
                         defaults=DEFAULTS, request_cost=cost.cost)
