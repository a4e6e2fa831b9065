"""How long a request will wait and take, for the web page (docs/ui.md): the cluster's snapshot, the recent cost
of a request, and the expected start of a request queued now (`/v1/status`) or of a queued job (its job object)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from replicadp_tasks.contract import Priority, RequestState, keys

from ..ops.status import snapshot
from .gateway import Gateway, Refreshed
from .schema import CostModel

SNAPSHOT_CACHE_S = 1.0  # pages poll every second: they share one snapshot (a few Redis reads) at a time
RECENT_CACHE_S = 5.0  # the recent cost changes as requests complete: reading 40 jobs once in this is enough
MEAN_OVER_JOBS = 20  # the recent cost: over this many of the latest jobs that completed


@dataclass(frozen=True)
class Recent:
    """What the latest completed jobs took on their replica (the Result's timings.total_s)."""

    mean_request_s: float | None  # None: none completed lately
    cost: CostModel | None  # what a request of a given size takes; None: none completed lately


@dataclass(frozen=True)
class Capacity:
    """What the serving replicas can take, from a snapshot."""

    serving: int
    idle: int  # serving and running nothing
    left: float  # what the running requests have left, in requests (1 - step / total_steps each)


def _shared(request: Request, name: str, read, max_age: float) -> Refreshed:
    state = request.app.state
    if not hasattr(state, name):
        setattr(state, name, Refreshed(read, max_age))
    return getattr(state, name)


def snapshots(request: Request) -> Refreshed:
    """`replicadp status`'s snapshot (client/ops/status.py), taken in a thread and shared by every polling page
    while SNAPSHOT_CACHE_S fresh: any number of pages cost one snapshot at a time."""
    return _shared(request, "snapshots", lambda: asyncio.to_thread(snapshot), SNAPSHOT_CACHE_S)


def recents(request: Request) -> Refreshed:
    """The Recent cost, shared like the snapshot while RECENT_CACHE_S fresh."""
    gw = request.app.state.gateway
    return _shared(request, "recents", lambda: recent(gw), RECENT_CACHE_S)


async def recent(gw: Gateway) -> Recent:
    """The Recent cost over the latest MEAN_OVER_JOBS completed jobs among the latest jobs of every gateway on
    this Redis."""
    ids = [i.decode() for i in await gw.redis.zrevrange(keys.JOBS_KEY, 0, 2 * MEAN_OVER_JOBS - 1)]
    done = [meta["result"] for _, meta in await gw.job_records(ids)
            if meta and meta["status"] == RequestState.SUCCESS][:MEAN_OVER_JOBS]
    if not done:
        return Recent(None, None)
    seen = [(units(r.get("params") or {}), r["timings"]["total_s"]) for r in done]
    return Recent(sum(t for _, t in seen) / len(seen), cost_model([(u, t) for u, t in seen if u > 0]))


def units(params: dict) -> float:
    """A request's size in megapixel-frame-steps: width x height x num_frames / 1e6 x num_inference_steps."""
    return (params.get("width", 0) * params.get("height", 0) * params.get("num_frames", 0) / 1e6
            * params.get("num_inference_steps", 0))


def cost_model(seen: list[tuple[float, float]]) -> CostModel | None:
    """seconds = fixed_s + per_unit_s x units, fitted (least squares) to (units, seconds) of recent jobs; through
    the origin where they are all of about one size (nothing tells the fixed part from the rest) or the fit
    gives a negative fixed part; flat where it gives a negative slope."""
    if not seen:
        return None
    us, ts = [u for u, _ in seen], [t for _, t in seen]
    low, high = min(us), max(us)
    mean_u, mean_t = sum(us) / len(us), sum(ts) / len(ts)
    fixed, slope = 0.0, sum(u * t for u, t in seen) / sum(u * u for u in us)
    if high >= 1.5 * low:
        fitted = sum((u - mean_u) * (t - mean_t) for u, t in seen) / sum((u - mean_u) ** 2 for u in us)
        if fitted < 0:
            fixed, slope = mean_t, 0.0
        elif mean_t - fitted * mean_u >= 0:
            fixed, slope = mean_t - fitted * mean_u, fitted
    return CostModel(fixed_s=round(fixed, 3), per_unit_s=slope, min_units=low, max_units=high)


def capacity(snap: dict) -> Capacity:
    serving = [r for r in snap["replicas"] if r["serving"]]
    return Capacity(serving=len(serving), idle=sum(not r["request_id"] for r in serving),
                    left=sum(1 - (r["step"] or 0) / r["total_steps"] if r["total_steps"] else 1
                             for r in serving if r["request_id"]))


def expected_start_s(ahead: int, cap: Capacity, mean: float | None) -> float | None:
    """Seconds until a queued request with `ahead` requests before it starts: 0 while a serving replica would be
    idle for it; else the work ahead of it (those requests, plus what the running ones have left) in units of
    `mean`, shared by the serving replicas. None when unknown: no serving replica, or no mean."""
    if not cap.serving:
        return None
    if ahead < cap.idle:
        return 0.0
    if mean is None:
        return None
    return round((ahead - cap.idle + cap.left) * mean / cap.serving, 1)


def expected_wait_s(cap: Capacity, queued: dict[Priority, int], mean: float | None) -> dict[str, float | None]:
    """Per priority, expected_start_s of a request queued now at it: it waits behind the requests queued at its
    priority and above."""
    waits, ahead = {}, 0
    for priority, n in queued.items():  # highest first
        ahead += n
        waits[str(priority)] = expected_start_s(ahead, cap, mean)
    return waits
