"""How long a request will wait and take, for the web page (docs/ui.md), per model: what recent jobs took by their
size, how fast steps go now, and a plan of the model's queue: when each queued request should start
(`expected_start_s` in its job object) and when one sent now would (`/v1/status`)."""

from __future__ import annotations

import asyncio
import heapq
import math
from dataclasses import dataclass, field

from fastapi import Request

from replicadp_tasks.broker import queue_order, queue_order_call
from replicadp_tasks.contract import Priority, RequestState, keys, queue_for
from replicadp_tasks.settings import SETTINGS

from ..ops.status import snapshot
from .gateway import Gateway, Refreshed
from .schema import CostModel

SNAPSHOT_CACHE_S = 1.0  # pages poll every second: they share one snapshot (a few Redis reads) at a time
RECENT_CACHE_S = 5.0  # the recent cost changes as requests complete: reading the latest jobs once in this is enough
PLAN_CACHE_S = 1.0  # the queue's plan, shared like the snapshot
RECENT_JOBS = 100  # the latest jobs of every model read for the recent cost
MEAN_OVER_JOBS = 20  # a model's recent cost: over this many of its latest jobs that completed
PLAN_SCAN = 200  # queued requests per model whose size the plan reads (from their job); past them, each is the mean
# How much slower (or faster) steps go now than the recent jobs' fit says, from the requests running: a bound, so
# that one request's first seconds (its inputs' download, say) cannot make every estimate absurd.
LOAD_RANGE = (0.25, 8.0)
LOAD_AFTER_S = 2.0  # a running request tells the pace once it has run this long and made a step
REPORT_LAG_S = 0.25  # a replica reports its step at most every 0.5 s: on average, a step is seen this late


@dataclass(frozen=True)
class Recent:
    """What a model's latest completed jobs took on their replica (the Result's timings.total_s)."""

    mean_request_s: float | None  # None: none completed lately
    cost: CostModel | None  # what a request of a given size takes; None: none completed lately
    after_steps_s: float | None  # what followed the last step (decode, encode, store); None: not measured


NONE = Recent(None, None, None)


@dataclass(frozen=True)
class Plan:
    """One model's queue as it should go, from its serving replicas, what they run and what waits, in order."""

    load: float  # how much longer steps take now than the recent jobs' fit says (1: as long)
    starts: dict[str, float | None] = field(default_factory=dict)  # queued job id -> seconds until it starts
    waits: dict[str, float | None] = field(default_factory=dict)  # per priority: of a request sent now
    waiting: dict[str, int] = field(default_factory=dict)  # per priority: requests waiting, cancelled ones left out


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
    """Each model's Recent cost ({model: Recent}), shared like the snapshot while RECENT_CACHE_S fresh."""
    gw = request.app.state.gateway
    return _shared(request, "recents", lambda: recent(gw), RECENT_CACHE_S)


def plans(request: Request) -> Refreshed:
    """Each model's Plan ({model: Plan}), shared like the snapshot while PLAN_CACHE_S fresh."""
    gw = request.app.state.gateway

    async def read() -> dict[str, Plan]:
        snap, costs = await snapshots(request).get(), await recents(request).get()
        return {m: await plan(gw, snap, costs.get(m, NONE), m) for m in await gw.models()}

    return _shared(request, "plans", read, PLAN_CACHE_S)


async def recent(gw: Gateway) -> dict[str, Recent]:
    """The Recent cost of each model over its latest MEAN_OVER_JOBS completed jobs among the latest RECENT_JOBS
    jobs of every gateway on this Redis."""
    ids = [i.decode() for i in await gw.redis.zrevrange(keys.JOBS_KEY, 0, RECENT_JOBS - 1)]
    done: dict[str, list[dict]] = {}
    for _, meta in await gw.job_records(ids):
        if meta and meta["status"] == RequestState.SUCCESS:
            done.setdefault(meta["result"]["model"], []).append(meta["result"])
    return {model: recent_of(results[:MEAN_OVER_JOBS]) for model, results in done.items()}


def recent_of(done: list[dict]) -> Recent:
    seen = [(units(r.get("params") or {}), r["timings"]["total_s"]) for r in done]
    after = [r["timings"]["total_s"] - r["timings"]["dit_s"] for r in done if r["timings"].get("dit_s") is not None]
    return Recent(sum(t for _, t in seen) / len(seen), cost_model([(u, t) for u, t in seen if u > 0]),
                  sum(after) / len(after) if after else None)


def units(params: dict) -> float:
    """A request's size in megapixel-frame-steps: width x height x num_frames / 1e6 x num_inference_steps."""
    return (params.get("width", 0) * params.get("height", 0) * params.get("num_frames", 0) / 1e6
            * params.get("num_inference_steps", 0))


def record_units(record: dict | None) -> float:
    """units() of a job's record (its size, frames and steps as sent); 0 where it does not say them (a job from
    before the record kept its steps)."""
    if not record or "x" not in str(record.get("size", "")):
        return 0.0
    width, height = (int(v) for v in record["size"].split("x"))
    return units({"width": width, "height": height, "num_frames": record.get("num_frames", 0),
                  "num_inference_steps": record.get("num_inference_steps", 0)})


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


def seconds(recent: Recent, size: float) -> float | None:
    """What a request of `size` units takes at the recent jobs' pace: the fit where the size is known, else the
    mean; None while none completed."""
    if recent.cost is not None and size > 0:
        return recent.cost.fixed_s + recent.cost.per_unit_s * size
    return recent.mean_request_s


def load_of(recent: Recent, running: list[tuple[dict, dict | None]]) -> float:
    """How much longer steps take now than the fit says: over the requests denoising (snapshot rows, with their
    job records), the time they have run against what the fit gives their steps so far. 1 without one."""
    ran = expected = 0.0
    for row, record in running:
        size, step, total = record_units(record), row["step"] or 0, row["total_steps"]
        if (recent.cost is None or not size or not step or not total or row["phase"] != "denoising"
                or (row["running_s"] or 0) < LOAD_AFTER_S):
            continue
        ran += row["running_s"] - REPORT_LAG_S
        expected += recent.cost.per_unit_s * size * step / total
    if not ran or not expected:
        return 1.0
    return min(max(ran / expected, LOAD_RANGE[0]), LOAD_RANGE[1])


async def plan(gw: Gateway, snap: dict, recent: Recent, model: str) -> Plan:
    """`model`'s queue played out on its serving replicas: each takes the next request as it becomes free (a
    running request frees it once its expected time, at the current pace, has passed); a queued request costs
    what its size takes at that pace (the mean for one without a job record, nothing for one cancelled: a replica
    drops it at once). Fluid otherwise: it ignores the round robin across users and tenants that may place a
    request sent later before one sent earlier."""
    serving = [r for r in snap["replicas"] if r["serving"] and r["model"] == model]
    levels = queue_order(await gw.redis.eval(*queue_order_call(queue_for(SETTINGS.queue, model), PLAN_SCAN)))
    lengths, queued = [length for _, length, _ in levels], [[i for i in ids if i] for _, _, ids in levels]
    running = [r["request_id"] for r in serving if r["request_id"]]
    ids = [i for ids in queued for i in ids]
    records = {record["id"]: record for record, _ in await gw.job_records(running + ids)}
    cancelled = {i for i, flag in zip(ids, await gw.redis.mget([keys.CANCEL_KEY + i for i in ids]) if ids else [])
                 if flag}
    load = load_of(recent, [(r, records.get(r["request_id"])) for r in serving if r["request_id"]])

    def cost(record: dict | None) -> float:
        s = seconds(recent, record_units(record))
        return math.inf if s is None else s * load

    free = [0.0 if not r["request_id"] else max(0.0, cost(records.get(r["request_id"])) - (r["running_s"] or 0))
            for r in serving]
    heapq.heapify(free)
    out = Plan(load=round(load, 2))
    for priority, length, ids_here in zip(Priority, lengths, queued):
        for i in ids_here:
            start = free[0] if free else math.inf
            out.starts[i] = None if math.isinf(start) else round(start, 1)
            if free:
                heapq.heapreplace(free, start + (0.0 if i in cancelled else cost(records.get(i))))
        for _ in range(length - len(ids_here)):  # past the scan: each as the mean
            if free:
                heapq.heapreplace(free, free[0] + cost(None))
        start = free[0] if free else math.inf
        out.waits[str(priority)] = None if math.isinf(start) else round(start, 1)
        out.waiting[str(priority)] = length - len(set(ids_here) & cancelled)
    return out
