"""The routes: vllm-omni's video API (`/v1/videos/sync`, `/v1/videos`), `/v1/models` and `/health`."""

from __future__ import annotations

import asyncio
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from kombu.exceptions import OperationalError

from replicadp_tasks.contract import Quality, RequestState

from ..api import cancel_request, fetch_video, remove_video
from ..ops.status import fast_path, recipe_of
from .auth import KeyPolicy, signed_link
from .errors import ErrorCode, GatewayError, failure
from .form import VideoForm, video_form
from .gateway import Gateway
from .jobs import job_view, video_response
from .schema import (ERRORS, Health, JobOrder, ModelCard, ModelList, ModelReplica, VideoDeleted, VideoJob, VideoLinks,
                     VideoList)
from .waits import plans

router = APIRouter()
KEEP = "private, max-age=31536000, immutable"  # a job's video and poster never change: a browser keeps them
POSTER_PX = 320  # a poster's long side: a gallery's thumbnail, ~10 kB


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def policy(request: Request) -> KeyPolicy | None:
    """The policy of the API key the request came with (auth.ApiKeys); None when the gateway has no keys."""
    return getattr(request.state, "policy", None)


def owner(request: Request) -> str | None:
    """The tenant of the API key the request came with; None when the gateway has no keys."""
    found = policy(request)
    return found.owner if found else None


GatewayDep = Annotated[Gateway, Depends(gateway)]
OwnerDep = Annotated[str | None, Depends(owner)]
PolicyDep = Annotated[KeyPolicy | None, Depends(policy)]
VideoFormDep = Annotated[VideoForm, Depends(video_form)]


@router.post("/v1/videos/sync", response_class=Response, responses={
    200: {"content": {"video/mp4": {}}, "description": "The MP4, with X-Request-Id, X-Model, X-Replica and "
                                                      "X-Inference-Time-S headers."}, **ERRORS})
async def create_video_sync(request: Request, form: VideoFormDep, gw: GatewayDep, key: PolicyDep):
    """Generate one video and answer with its MP4 bytes (503 with its job id if the gateway stops first)."""
    meta = await gw.run_sync(await gw.admit(form, key), request, key and key.owner)
    if meta["status"] != RequestState.SUCCESS:
        raise failure(meta)
    return video_response(meta["result"], await asyncio.to_thread(fetch_video, meta["result"]))


@router.post("/v1/videos", response_model=VideoJob, responses=ERRORS)
async def create_video(form: VideoFormDep, gw: GatewayDep, key: PolicyDep):
    """Queue one video; answers at once with the job (poll GET /v1/videos/{id})."""
    admitted = await gw.admit(form, key)
    record = await gw.add_job(admitted, key and key.owner)
    try:
        await gw.send(admitted)
    except OperationalError:  # the broker is down: no job was made (503), so none must be listed
        await gw.forget(record)
        raise
    return job_view(record, None)


async def shown(request: Request, gw: Gateway, found: list[tuple[dict, dict | None]]) -> list[VideoJob]:
    """The job objects of (record, result meta) pairs, a queued one with its place in the queue and its expected
    start (waits.plan); a job deleted while it ran whose video was stored meanwhile has it removed."""
    jobs = [job_view(record, meta) for record, meta in found]
    if any(job.status == "queued" for job in jobs):
        positions, planned = await gw.queue_positions(), await plans(request).get()
        for job in jobs:
            if job.status == "queued" and job.id in positions:
                job.queue_position = positions[job.id]
                job.expected_start_s = planned[job.model].starts.get(job.id) if job.model in planned else None
    for record, meta in found:
        if "cancelled_at" in record and meta and meta["status"] == RequestState.SUCCESS:
            await asyncio.to_thread(remove_video, meta["result"])  # what the gateway's watch may have missed
    return jobs


@router.get("/v1/videos", response_model=VideoList, responses=ERRORS)
async def list_videos(request: Request, gw: GatewayDep, who: OwnerDep,
                      limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None,
                      order: JobOrder = "desc"):
    """Jobs created through any gateway of this Redis (with API keys: with this key), newest first (order=asc:
    oldest first)."""
    ids = await gw.job_ids(limit, after, order, who)
    jobs = await shown(request, gw, await gw.job_records(ids[:limit]))
    return VideoList(data=jobs, first_id=jobs[0].id if jobs else None, last_id=jobs[-1].id if jobs else None,
                     has_more=len(ids) > limit)


@router.get("/v1/videos/{video_id}", response_model=VideoJob, responses=ERRORS)
async def get_video(request: Request, video_id: str, gw: GatewayDep, who: OwnerDep):
    """One job: status, phase, progress (0-100, from the denoising step), its place in the queue, error."""
    return (await shown(request, gw, [await gw.job(video_id, who)]))[0]


async def completed(gw: Gateway, video_id: str, who: str | None) -> dict:
    """The result meta of a completed job; 409 (its error, or poll until it completes) for any other."""
    record, meta = await gw.job(video_id, who)
    job = job_view(record, meta)
    if job.status == "failed":
        raise GatewayError(409, f"video_id={video_id!r}: the job failed, it has no video ({job.error.code}: "
                                f"{job.error.message})", code=ErrorCode.NOT_COMPLETED, param="video_id")
    if job.status != "completed":
        raise GatewayError(409, f"video_id={video_id!r}: the job is {job.status}, not completed; poll GET "
                                f"/v1/videos/{video_id} until it is", code=ErrorCode.NOT_COMPLETED,
                           param="video_id", headers={"Retry-After": "1"})
    return meta


@router.get("/v1/videos/{video_id}/content", response_class=Response, responses={
    200: {"content": {"video/mp4": {}}, "description": "The MP4 of a completed job."}, **ERRORS})
async def get_video_content(request: Request, video_id: str, gw: GatewayDep, who: OwnerDep):
    """The MP4 of a completed job, the same bytes a sync request for the same input answers; a browser may keep
    it (a job's video never changes). A `Range: bytes=...` of one range answers 206 with those bytes: a
    player starts before the whole file has come (and reads the index at its end first)."""
    result = (await completed(gw, video_id, who))["result"]
    video = await asyncio.to_thread(fetch_video, result)
    etag = f'"{result["video_sha256"]}"'
    asked = request.headers.get("range") if request.headers.get("if-range", etag) == etag else None
    part = byte_range(asked, len(video)) if asked else None
    if part == ():
        return Response(status_code=416, headers={"Content-Range": f"bytes */{len(video)}", "Accept-Ranges": "bytes"})
    response = video_response(result, video[part[0]:part[1] + 1] if part else video)
    response.headers.update({"Cache-Control": KEEP, "ETag": etag, "Accept-Ranges": "bytes"})
    if part:
        response.status_code = 206
        response.headers["Content-Range"] = f"bytes {part[0]}-{part[1]}/{len(video)}"
    return response


def byte_range(header: str, size: int) -> tuple[int, int] | tuple[()] | None:
    """The (first, last) byte of a `Range: bytes=...` header of one range over `size` bytes; () where it cannot be
    satisfied (416); None where it is not one such range (several ranges, another unit, bad syntax: the whole file,
    as RFC 9110 lets a server answer)."""
    unit, _, spec = header.partition("=")
    first, dash, last = spec.strip().partition("-")
    if unit.strip().lower() != "bytes" or "," in spec or not dash or not (first + last).isdigit():
        return None
    if not first:  # the last N bytes
        return (max(0, size - int(last)), size - 1) if int(last) and size else ()
    if int(first) >= size or (last and int(last) < int(first)):
        return () if int(first) >= size else None
    return int(first), min(size - 1, int(last)) if last else size - 1


@router.get("/v1/videos/{video_id}/poster", response_class=Response, responses={
    200: {"content": {"image/jpeg": {}}, "description": "The first frame of a completed job's video."}, **ERRORS})
async def get_video_poster(video_id: str, gw: GatewayDep, who: OwnerDep):
    """The first frame of a completed job's video, a JPEG at most POSTER_PX on its long side: what a gallery
    shows before the MP4 is played. Made from the MP4 on the first ask and kept as long as the job."""
    result = (await completed(gw, video_id, who))["result"]
    return Response(await gw.poster(video_id, result, POSTER_PX), media_type="image/jpeg",
                    headers={"Cache-Control": KEEP, "ETag": f'"{result["video_sha256"]}-poster"'})


@router.get("/v1/videos/{video_id}/links", response_model=VideoLinks, responses=ERRORS)
async def get_video_links(video_id: str, gw: GatewayDep, key: PolicyDep):
    """Links to a completed job's MP4 and poster that a browser's `<video>` and `<img>` read without sending the
    key: signed by the key that asks, for that job's files, for an hour (auth.LINK_S); 409 as `/content`."""
    await completed(gw, video_id, key and key.owner)
    paths = [f"/v1/videos/{video_id}/{name}" for name in ("content", "poster")]
    if key is None:
        return VideoLinks(content=quote(paths[0]), poster=quote(paths[1]), expires_at=None)
    (content, expires), (poster, _) = (signed_link(key, path) for path in paths)
    return VideoLinks(content=content, poster=poster, expires_at=expires)


@router.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=ERRORS)
async def delete_video(video_id: str, gw: GatewayDep, who: OwnerDep):
    """Delete a job. A queued one is forgotten and never runs. A running one stops at its next denoising step, or,
    past its last, is not stored (or is removed once stored: the replica checks for the cancel as it stores, and
    the gateway watches the request until it ends); it is no longer listed, and GET /v1/videos/{id} shows it
    `cancelling` until its replica stops, then cancelled. A completed job's video and metadata are removed from
    the output store first (its request_id is the job id: the gateway passes none of its own), so that a store
    that fails (502) leaves a job to delete again."""
    record, meta = await gw.job(video_id, who)
    job = job_view(record, meta)
    if job.status in ("queued", "in_progress"):
        await asyncio.to_thread(cancel_request, video_id)
    if job.status == "in_progress":
        if "cancelled_at" not in record:
            await gw.mark_cancelled(record)
            gw.watch_cancelled(video_id)
        return VideoDeleted(id=video_id, deleted=True)
    if job.status == "completed":
        await asyncio.to_thread(remove_video, meta["result"])
    await gw.forget(record)
    return VideoDeleted(id=video_id, deleted=True)


@router.get("/v1/models", response_model=ModelList)
async def list_models(gw: GatewayDep):
    """Every model this deployment serves (declared, or loaded by a live replica), with the live replicas that
    serve it (none: its requests wait for one), each one's fast path (quality=fast: its step cache), and how many
    requests wait in its queue."""
    live = await gw.replicas()
    cards = []
    for m in await gw.models():
        mine = [r for r in live if r.get("model") == m]
        cards.append(ModelCard(id=m, created=min((int(r.get("loaded_at", 0)) for r in mine), default=0),
                               queue_depth=await gw.queue_depth(m), replicas=[
            ModelReplica(name=r["name"], qualities=r.get("qualities") or [Quality.STANDARD], fast_path=fast_path(r),
                         loras=[a["name"] for a in r.get("loras") or []],
                         fused=[a["name"] for a in r.get("fused") or []],
                         recipe=recipe_of(r)) for r in mine]))
    return ModelList(data=cards)


@router.get("/health", response_model=Health, responses={503: {"model": Health}})
async def health(gw: GatewayDep):
    """200 while at least one replica is live, else 503."""
    names = [r["name"] for r in await gw.replicas()]
    body = Health(status="ok" if names else "unavailable", replicas=names, queue_depth=await gw.queue_depth())
    return JSONResponse(body.model_dump(), status_code=200 if names else 503)
