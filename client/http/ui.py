"""The web page (`/ui`, docs/ui.md) and the one route only it needs, `GET /v1/status`: the live replicas, what each
runs, the queue and the expected wait. The pages are static files (HTML, CSS, JS, an SVG icon; no build step) served
without a key, as /docs is; everything it shows comes from /v1, with the key the user types in."""

from __future__ import annotations

import json
import os
import time
from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse, Response

from replicadp_tasks.contract import DEFAULTS as REQUEST_DEFAULTS, InvalidRequest, Priority, choose_model, keys
from replicadp_tasks.settings import SETTINGS

from ..ops.status import accepted_by

from .errors import ErrorCode, GatewayError
from .jobs import job_view
from .routes import GatewayDep, OwnerDep
from .schema import ERRORS, ClusterStatus, ModelStatus, ReplicaStatus, RunningRequest
from .waits import NONE, Plan, Recent, plans, recents, snapshots

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


def page_file(request: Request, name: str, media_type: str) -> Response:
    """A file of the pages, or 304 where the browser's copy is current (its If-None-Match is the file's ETag): the
    files are `no-cache`, revalidated at each load, and on a slow connection their 60 kB again would take seconds
    (Starlette's FileResponse does not answer conditional requests)."""
    path = STATIC / name
    response = FileResponse(path, media_type=media_type, headers=PAGE_HEADERS, stat_result=os.stat(str(path)))
    if request.headers.get("if-none-match") == response.headers["etag"]:
        return Response(status_code=304, headers={**PAGE_HEADERS, "ETag": response.headers["etag"]})
    return response


@router.get("/", include_in_schema=False)
async def root():
    return RedirectResponse("/ui")


@router.get("/ui/", include_in_schema=False)
async def slash():
    return RedirectResponse("/ui")  # a path, not a URL: nothing taken from the Host header


@router.get("/ui", include_in_schema=False)
async def page(request: Request):
    return page_file(request, "index.html", "text/html")


@router.get("/ui/videos/{video_id}", include_in_schema=False)
async def video_page(request: Request, video_id: str):
    """A video's own page (bookmarkable): static, as /ui is; its script reads the id from the URL and asks /v1
    for the job, with the key the user gave."""
    return page_file(request, "video.html", "text/html")


@router.get("/ui/{name}", include_in_schema=False)
async def asset(request: Request, name: str):
    if name not in ASSETS:
        raise GatewayError(404, f"name={name!r}: the page has no such file", code=ErrorCode.NOT_FOUND, param="name")
    return page_file(request, name, ASSETS[name])


@router.get("/favicon.ico", include_in_schema=False)
async def favicon(request: Request):
    """What a browser asks for without a page's <link rel=icon> (a JSON response, say): the SVG icon, not a 404."""
    return page_file(request, "favicon.svg", "image/svg+xml")


@router.get("/v1/status", response_model=ClusterStatus, responses=ERRORS)
async def status(request: Request, gw: GatewayDep, owner: OwnerDep):
    """The live replicas (what each serves, and runs at which step), the queue per priority and the expected wait
    of a request queued now, in all and per model; what the web page polls (docs/ui.md). A running request is
    named, with its prompt, phase and step (from its job, as GET /v1/videos/{id} shows them), only to its own
    owner (the caller's API key; without one, keyless jobs): anyone else sees the replica busy. A request that
    has ended is not shown running, though the snapshot may still say so."""
    snap = await snapshots(request).get()
    names = [r["name"] for r in snap["replicas"]]
    raws = await gw.redis.mget([keys.REPLICA_KEY + n for n in names]) if names else []
    infos = [json.loads(raw) if raw else {} for raw in raws]
    ids = [r["request_id"] for r in snap["replicas"] if r["request_id"]]
    now = time.time()
    mine = {record["id"]: job_view(record, meta, now) for record, meta in await gw.job_records(ids)
            if record.get("owner") == owner}
    replicas = []
    for seen, info in zip(snap["replicas"], infos):
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
    served, costs, planned = await gw.models(), await recents(request).get(), await plans(request).get()
    models = [model_status(m, [i for i in infos if i.get("model") == m], infos, costs.get(m, NONE), planned.get(m))
              for m in served]
    try:
        default = choose_model(None, served, SETTINGS.default_model) if served else None
    except InvalidRequest:  # several served, none the default
        default = None
    shown = next((m for m in models if m.id == default), models[0] if models else None)
    queued = await gw.queue_by_priority()
    return ClusterStatus(replicas=replicas, queue_depth=sum(queued.values()),
                         queue_by_priority={str(p): n for p, n in queued.items()},
                         mean_request_s=shown.mean_request_s if shown else None,
                         expected_wait_s=shown.expected_wait_s if shown else {str(p): None for p in Priority},
                         defaults=shown.defaults if shown else DEFAULTS,
                         request_cost=shown.request_cost if shown else None, models=models, default_model=default)


def model_status(model: str, infos: list[dict], every: list[dict], recent: Recent, plan: Plan | None) -> ModelStatus:
    """`model` as the form offers it: its live replicas' recipe (what a request leaves out gets, what it may not
    change), its queue and estimates; a few-step model's exact model: one whose replicas load the same checkpoint
    without a recipe (the final of a preview made here)."""
    recipe = accepted_by(infos).recipe if infos else None
    defaults = {**DEFAULTS, **(recipe.defaults() if recipe else {})}
    final = None
    if recipe is not None:
        mine = {i.get("checkpoint") for i in infos}
        final = next((i["model"] for i in every if i.get("model") not in (None, model) and not i.get("recipe")
                      and i.get("checkpoint") in mine), None)
    plan = plan or Plan(load=1.0)
    return ModelStatus(
        id=model, queue_by_priority=plan.waiting or {str(p): 0 for p in Priority},
        expected_wait_s=plan.waits or {str(p): None for p in Priority}, mean_request_s=recent.mean_request_s,
        request_cost=recent.cost, load=plan.load, after_steps_s=recent.after_steps_s, defaults=defaults,
        recipe=recipe.describe() if recipe else None,
        fixed=[f for f in ("num_inference_steps", "guidance_scale") if recipe and recipe.strict], final=final)
