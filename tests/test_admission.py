"""The HTTP front door's admission under a burst (issue #18): many requests at once, through one gateway or
several on one Redis, get their normal answer or a 429 with Retry-After, never a 503 from a connection pool run
dry, and a model's queue never holds more than --max-queue requests."""

import asyncio
import threading
from collections import Counter
from contextlib import ExitStack, contextmanager

import httpx
import redis
from conftest import start_replicas
from helpers import SYNTHETIC, lasting, model_queue, queue_depth, wait_for
from test_http import SMALL, form_of, gateway, multipart

from replicadp_tasks.contract.keys import ADMITTING_KEY, CANCEL_KEY

BURST = 200
LIMIT = 5


@contextmanager
def queue_sampled(url: str, model: str = "tiny"):
    """The largest length of `model`'s queue (LLEN) seen by a thread that reads it as fast as it can while the
    block runs, and once more after it: `peak["max"]`, `peak["samples"]`."""
    client = redis.Redis.from_url(url)
    peak = {"max": 0, "samples": 0}
    done = threading.Event()

    def poll():
        while not done.is_set():
            peak["max"] = max(peak["max"], queue_depth(client, model))
            peak["samples"] += 1

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        yield peak
    finally:
        done.set()
        poller.join()
        peak["max"] = max(peak["max"], queue_depth(client, model))


def burst(targets: list[tuple[str, str]], form: dict, timeout: float = 300) -> list[httpx.Response]:
    """One request per (base URL, route) in `targets`, all sent at once (one connection each)."""
    async def run():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            return await asyncio.gather(*(client.post(base + route, files=multipart(form))
                                          for base, route in targets))

    return asyncio.run(run())


def check_answers(answers: list[httpx.Response], ok: int) -> Counter:
    """Every answer is `ok` or a 429 with a whole number of seconds in Retry-After; returns the status counts."""
    counts = Counter(a.status_code for a in answers)
    assert set(counts) <= {ok, 429}, {a.status_code: a.text for a in answers if a.status_code not in (ok, 429)}
    for a in answers:
        if a.status_code == 429:
            assert a.json()["error"]["code"] == "queue_full" and int(a.headers["retry-after"]) >= 1, a.text
    return counts


def test_a_burst_of_async_requests_never_queues_past_the_limit(redis_db):
    """200 POST /v1/videos at once against --max-queue 5 with no replica: each is a queued job (200) or a 429
    with Retry-After, none a 503; the queue, sampled throughout, never holds more than 5; it holds exactly the
    admitted jobs; and once the burst is over the admissions left no count behind (the queue fills to exactly
    5, no further)."""
    url = redis_db()
    with gateway(url, "burst-async", "--max-queue", str(LIMIT)) as gw:
        with queue_sampled(url) as peak:
            counts = check_answers(burst([(gw.url, "/v1/videos")] * BURST, SMALL), 200)
        assert 1 <= counts[200] <= LIMIT and peak["max"] <= LIMIT and peak["samples"] > 10, (counts, peak)
        client = redis.Redis.from_url(url)
        assert queue_depth(client) == counts[200]
        for _ in range(LIMIT - counts[200]):
            assert gw.client.post("/v1/videos", files=multipart(SMALL)).status_code == 200
        assert gw.client.post("/v1/videos", files=multipart(SMALL)).status_code == 429
        assert queue_depth(client) == LIMIT


def test_a_burst_of_sync_requests_gets_videos_or_429(redis_db):
    """200 POST /v1/videos/sync at once against --max-queue 5, one replica whose requests take 0.5 s each: every
    answer is an MP4 (200) or a 429 with Retry-After, none a 503, and the queue never holds more than 5."""
    url = redis_db()
    group = start_replicas(1, url, "burst-sync", model=SYNTHETIC)
    try:
        with gateway(url, "burst-sync", "--max-queue", str(LIMIT)) as gw:
            form = form_of(lasting(0.5, prompt="burst"))
            with queue_sampled(url, SYNTHETIC) as peak:
                answers = burst([(gw.url, "/v1/videos/sync")] * BURST, form)
            counts = check_answers(answers, 200)
            assert counts[200] >= 1 and peak["max"] <= LIMIT and peak["samples"] > 10, (counts, peak)
            assert all(a.headers["content-type"] == "video/mp4" for a in answers if a.status_code == 200)
    finally:
        group.stop()


def test_two_gateways_under_one_burst_share_the_limit(redis_db):
    """Two gateway processes on one Redis, 100 requests at once to each (async and sync alike), --max-queue 5,
    no replica: the limit holds across them (the queue never over 5, at most 5 admitted between both), every
    answer is its normal one or a 429, none a 503. The sync requests admitted end 504 after their 3 s sync
    timeout, as without a burst."""
    url = redis_db()
    with ExitStack() as stack:
        gws = [stack.enter_context(gateway(url, f"burst-{name}", "--max-queue", str(LIMIT), "--sync-timeout", "3"))
               for name in "ab"]
        targets = [(gw.url, route) for gw in gws for route in ("/v1/videos", "/v1/videos/sync")] * (BURST // 4)
        with queue_sampled(url) as peak:
            answers = burst(targets, SMALL)
        by_route = {route: [a for (_, r), a in zip(targets, answers) if r == route]
                    for route in ("/v1/videos", "/v1/videos/sync")}
        queued = check_answers(by_route["/v1/videos"], 200)
        timed_out = check_answers(by_route["/v1/videos/sync"], 504)
        assert 1 <= queued[200] + timed_out[504] <= LIMIT and peak["max"] <= LIMIT, (queued, timed_out, peak)
        assert all(a.json()["error"]["code"] == "timeout" for a in by_route["/v1/videos/sync"]
                   if a.status_code == 504)
        assert queue_depth(redis.Redis.from_url(url)) == queued[200] + timed_out[504]


def test_200_sync_requests_waiting_at_once_hold_no_connection_each(redis_db):
    """With room for all of them (--max-queue 1000) and no replica, 200 sync requests wait at once: all 200 are
    queued and answer 504 after the 3 s sync timeout, none a 503 (no connection pool runs dry, on the gateway's
    Redis client or for the cancels), and every one of them is cancelled."""
    url = redis_db()
    with gateway(url, "waiting", "--max-queue", "1000", "--sync-timeout", "3") as gw:
        answers = burst([(gw.url, "/v1/videos/sync")] * BURST, SMALL)
        assert Counter(a.status_code for a in answers) == {504: BURST}, [a.text for a in answers
                                                                         if a.status_code != 504][:3]
        client = redis.Redis.from_url(url)
        assert queue_depth(client) == BURST
        wait_for(lambda: len(client.keys(CANCEL_KEY + "*")) == BURST, f"all {BURST} requests to be cancelled",
                 timeout=30)


def test_admitted_requests_not_yet_queued_count_and_expire(redis_db):
    """Requests that some gateway admitted and has not yet pushed count against the limit (here 5 left behind by
    a gateway that died between admitting and sending: 429), until they are ADMIT_STALE_S old (then the next
    request is admitted)."""
    from client.http.admission import ADMIT_STALE_S

    url = redis_db()
    client = redis.Redis.from_url(url)
    with gateway(url, "reserved", "--max-queue", str(LIMIT)) as gw:
        seconds, micros = client.time()
        now = seconds + micros / 1e6
        client.zadd(ADMITTING_KEY + model_queue(), {f"ghost-{i}": now for i in range(LIMIT)})
        refused = gw.client.post("/v1/videos", files=multipart(SMALL))
        assert refused.status_code == 429 and f"{LIMIT} requests are waiting" in refused.json()["error"]["message"]
        client.zadd(ADMITTING_KEY + model_queue(), {f"ghost-{i}": now - ADMIT_STALE_S - 1 for i in range(LIMIT)})
        assert gw.client.post("/v1/videos", files=multipart(SMALL)).status_code == 200
        assert client.zcard(ADMITTING_KEY + model_queue()) == 0 and queue_depth(client) == 1
