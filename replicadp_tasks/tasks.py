"""The `generate` task: one request, from its message to the MP4 in the output store.

`generate` runs in a replica's pool child, over `child.current()` (the resident pipeline, the store, Redis) and
one `Delivery` (this delivery of the request). Delivery is at least once, a result is made once: a request that
already has a result gets it back, and only the delivery that holds the request's fence computes (lease.py); a
delivery that finds the fence another's is parked, and returns that one's result when it comes back.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
from celery import signals
from celery.utils.saferepr import saferepr

from .replica import child
from .cluster import lease, replication
from .app import app
from .contract.errors import (Finishing, GroupLost, InvalidRequest, Parked, PoisonRequest, ReplicaDPError,
                              RequestCancelled, RequestIdConflict)
from .inputs.images import load_first_frame
from .contract.keys import CANCEL_KEY, STATS_KEY, FenceToken, fence_key
from .cluster.lease import FenceAnswer, FenceState
from .model.pipeline import describe_device
from .contract.records import Phase, Progress, RequestState, Result
from .settings import SETTINGS
from .contract.request import GenerateRequest, input_key, validate_request
from .outputs.video import encode_mp4, frames_sha256
from .webhooks.events import Event, Webhook, check_webhook, emit

log = logging.getLogger("replicadp")
# PROGRESS within a phase at most this often (the first step and each change of phase always): each is a write of
# the result key (by the reporter thread, off the request's path, but a write Redis fsyncs), and a GPU step takes
# ~0.2 s; a person, `status` and `health` need no more than this.
PROGRESS_EVERY_S = 0.5
EXIT_FENCED_OUT = 75  # the exit status of a pool child whose delivery lost its fence (EX_TEMPFAIL)
EXIT_GROUP_LOST = 76  # ... whose multi-process group broke (parallel.GroupLost): its request is requeued
EXIT_UNANSWERED = 77  # ... whose finisher could not write a request's answer: that request is requeued


@app.task(name="replicadp.generate", bind=True, Request="replicadp_tasks.worker:ReplicaRequest")
def generate(self, prompt=None, **kwargs) -> Result:
    """Generate one video: compute its frames, then hand them to the finisher thread, which encodes, stores and
    answers it (errors.Finishing). A request answered here returns its Result (stored before) or raises (refused,
    cancelled, poison)."""
    started, me, task_id = time.time(), child.current(), self.request.id
    # 1. Can this replica's ranks serve it? An earlier request that ran out of memory on one of them left them
    #    apart: end the pool child before this request is counted; it is requeued and the next child rebuilds.
    if me.pipeline.group_broken is not None:
        log.error("request %s: the replica's ranks must form their group again (%s); the pool child exits, the "
                  "request is requeued", task_id, me.pipeline.group_broken)
        os._exit(EXIT_GROUP_LOST)
    # 2. Say that this replica took it (STARTED, Celery's meta, written by the reporter's thread), count the
    #    attempt (each earlier one ended its replica's process); cancelled before it started?
    me.reporter.put(task_id, RequestState.STARTED, {"pid": os.getpid(), "hostname": self.request.hostname},
                    self.request)
    finishing = False
    try:
        attempt, cancelled = me.start_attempt(task_id)
        if cancelled:
            raise RequestCancelled(f"request {task_id} was cancelled before it started")
        if attempt > SETTINGS.max_attempts:
            me.record_poison(task_id, {"prompt": prompt, **kwargs}, attempt - 1)
            raise PoisonRequest(f"request {task_id} ended its replica's process {attempt - 1} times; not retried "
                                f"again (REPLICADP_MAX_ATTEMPTS={SETTINGS.max_attempts})")
        # 3. Validate, and fetch the first frame.
        delivery = Delivery.of(self, {"prompt": prompt, **kwargs}, started)
        # 4. Take the fence, unless a delivery of this request_id has stored its result: then that is the answer;
        # or, if another live delivery holds it, raise Parked.
        earlier = delivery.take_fence()
        if earlier is not None:
            delivery.tell(Event.COMPLETED, result=earlier)
            return earlier
        me.fences.watch(delivery.fence, delivery.token)  # kept, and its cancel watched, by the fence keeper thread
        try:
            # 5. Run the pipeline: the frames. A broken group of ranks ends the process, not the request: it is
            #    requeued as a killed replica's is, and the pool's next child rebuilds the group.
            delivery.tell(Event.STARTED)
            me.finisher.computes()  # the request before it, if waiting, is finished meanwhile
            try:
                frames = delivery.compute()
            except GroupLost as exc:
                log.error("request %s: %s; the pool child exits, the request is requeued", delivery.request_id, exc)
                os._exit(EXIT_GROUP_LOST)
            # 6. Encode, store and answer it in the finisher thread, once the request before it there is done
            #    (Delivery.finish); meanwhile this replica takes its next request.
            me.finisher.submit(functools.partial(delivery.finish, frames), task_id, delivery.request_id)
            finishing = True
            raise Finishing(f"request {delivery.request_id}: frames computed; the finisher encodes, stores and "
                            "answers it")
        finally:
            if not finishing:
                delivery.let_go()
    finally:
        if not finishing:  # else the finisher answers it, once its records are written
            me.reporter.flush()  # its STARTED and progress records are written before Celery writes its result


@dataclass
class Delivery:
    """One delivery of one request to this pool child: what it asks for and who computes it."""

    context: object  # Celery's request context of this delivery (`task.request` moves on to the next request)
    req: GenerateRequest
    image: object  # the first frame (PIL), or None
    params: dict  # the effective inputs, as reported back
    input_key: str
    request_id: str  # the caller's, else the task id
    token: FenceToken
    started: float
    webhook: Webhook | None  # where its events go (webhooks.py)
    reported: float = 0.0  # when Progress was last written (monotonic)
    phase: Phase | None = None  # the phase last reported, since phase_started_at (unix time)
    phase_started_at: float = 0.0
    step: int = 0  # the denoising step last reached, of total_steps
    total_steps: int = 0
    released: bool = False  # its fence, with the completion's record (store)
    inference_s: float = 0.0  # how long compute() took
    cost: object = None  # the pipeline's RunStats of this request

    @classmethod
    def of(cls, task, kwargs: dict, started: float) -> "Delivery":
        """Validate `kwargs` for the loaded model (InvalidRequest names the field) and load the first frame."""
        pipeline = child.current().pipeline
        req = validate_request(kwargs, size_multiple=pipeline.size_multiple,
                               max_prompt_chars=SETTINGS.max_prompt_chars, max_work=SETTINGS.max_work,
                               qualities=pipeline.qualities, experts=pipeline.expert_count,
                               requires_image=pipeline.requires_image, defaults=pipeline.request_defaults,
                               loras=pipeline.lora_scales)
        image, image_sha256 = None, None
        if req.image is not None:
            if not pipeline.accepts_image:
                raise InvalidRequest.of("image", f"model {SETTINGS.model!r} is text-to-video only and takes no "
                                        "first frame", value=req.image[:40])
            image, image_sha256 = load_first_frame(
                req.image, req.width, req.height, max_bytes=SETTINGS.max_image_bytes,
                timeout_s=SETTINGS.image_timeout_s, image_dir=SETTINGS.image_dir, allow_nets=SETTINGS.fetch_allow,
                cancelled=lambda: child.current().cancelled(task.request.id))
        params = req.params(image_sha256)
        # Checked by validate_request, with the deployment's policy: only read here.
        webhook = check_webhook(kwargs.get("webhook"), kwargs.get("webhook_events"), policy=False,
                                tenant=kwargs.get("tenant"))
        return cls(context=task.request, req=req, image=image, params=params,
                   input_key=input_key(params, SETTINGS.model, pipeline.served(req)),
                   request_id=req.request_id or task.request.id,
                   token=FenceToken(task.request.hostname, os.getpid(), task.request.id), started=started,
                   webhook=webhook)

    @property
    def fence(self) -> str:
        return fence_key(self.request_id)

    def take_fence(self) -> Result | None:
        """Hold this request's fence and return None; or return the stored result, if one exists. If another
        live delivery holds the fence, raise Parked: this replica need not wait for that one's result, and its
        message waits in Redis for the fence to be free (lease.Keeper.park); this start is not counted."""
        me = child.current()
        # A failover keeps the fence: no second delivery computes meanwhile.
        answer = replication.durable(me.redis, lambda: lease.acquire(me.redis, self.fence, self.token, SETTINGS.lease_s),
                                     f"request {self.request_id}'s fence")
        done = me.store.get_meta(self.request_id)  # after the fence: a result stored just before counts
        if done is not None:
            if answer.ours:
                lease.release(me.redis, self.fence, self.token)
            if done["input_key"] != self.input_key:
                raise RequestIdConflict.of("request_id", "already used for different inputs", value=self.request_id)
            return {**done, "redelivered": True}
        if answer.ours:
            return None
        me.uncount_attempt(self.context.id)
        raise Parked(f"request {self.request_id} is being computed by {answer.owner}; parked until its fence is free")

    def let_go(self) -> None:
        """The request has ended here: stop keeping its fence, and release it unless the completion's record did."""
        me = child.current()
        me.fences.unwatch(self.token)
        if not self.released:
            lease.release(me.redis, self.fence, self.token)

    def still_ours(self, answer: FenceAnswer) -> None:
        """Exit the process unless this delivery still holds the fence. A Redis restart may have expired it (then
        it is ACQUIRED again); if another delivery holds it, or held it and stored the result, this one was
        presumed dead (its replica stopped for longer than a lease). Exit, not raise: the message is requeued,
        not acknowledged, as the shared delivery tag would acknowledge the other delivery's message."""
        if answer.state == FenceState.ACQUIRED and child.current().store.get_meta(self.request_id) is not None:
            answer = FenceAnswer(FenceState.TAKEN, "a delivery that stored its result")
        if not answer.ours:
            log.error("request %s: fence taken by %s; this delivery stops and its process exits", self.request_id,
                      answer.owner)
            os._exit(EXIT_FENCED_OUT)

    def on_step(self, step: int, total: int) -> None:
        """At every denoising step: stop if cancelled or fenced out; report Progress now and then. The fence
        keeper's last look answers, when it found all well within two ticks; else Redis does."""
        me = child.current()
        if not me.fences.clear(self.token):
            answer = lease.acquire_unless(me.redis, self.fence, self.token, SETTINGS.lease_s,
                                          CANCEL_KEY + self.context.id)
            if answer.state == FenceState.CANCELLED:
                raise RequestCancelled(f"request {self.context.id} was cancelled at step {step} of {total}")
            self.still_ours(answer)
        self.step, self.total_steps = step, total
        last = step == total  # the pipeline decodes next
        if last or time.monotonic() - self.reported >= PROGRESS_EVERY_S:
            self.report(Phase.DECODING if last else Phase.DENOISING)
            self.tell(Event.PROGRESS, step=step, total_steps=total)

    def report(self, phase: Phase) -> None:
        """Write this request's Progress (its result record, which its job, `status` and the CLI read): `phase`,
        since when, and the step; from the reporter's thread."""
        now = time.time()
        if phase != self.phase:
            self.phase, self.phase_started_at = phase, now
        self.reported = time.monotonic()
        child.current().reporter.put(self.context.id, RequestState.PROGRESS, Progress(
            phase=phase, phase_started_at=self.phase_started_at, step=self.step, total_steps=self.total_steps,
            replica=self.token.replica, request_id=self.request_id, pid=self.token.pid), self.context)

    def tell(self, event: Event, **fields) -> None:
        """Queue a webhook event of this request, if it asks for it: a Redis write, never a wait on the receiver
        (the replica's main process sends it)."""
        emit(child.current().redis, self.webhook, event, task_id=self.context.id, request_id=self.request_id,
             replica=self.token.replica, **fields)

    def compute(self) -> np.ndarray:
        """Denoise and decode: the frames."""
        pipeline = child.current().pipeline
        inference_started = time.time()
        frames = pipeline.generate(self.req, self.image, on_step=self.on_step)
        self.inference_s, self.cost = time.time() - inference_started, pipeline.last_run
        return frames

    def encode(self, frames: np.ndarray) -> tuple[bytes, Result]:
        """The MP4 and its Result (without its video_uri: the store sets it)."""
        pipeline = child.current().pipeline
        self.report(Phase.ENCODING)
        encoding, cost = time.time(), self.cost
        # A GPU replica's host has cores to spare beside its pipeline; a CPU replica's compute the other replicas'.
        threads = SETTINGS.encode_threads if pipeline.device == "cuda" else SETTINGS.threads
        video = encode_mp4(frames, self.req.fps, threads=threads)
        encoded = time.time()
        sent_at = self.context.get("replicadp_sent_at")
        return video, Result(
            request_id=self.request_id, replica=self.token.replica, device=describe_device(pipeline.device),
            model=SETTINGS.model, params=self.params, input_key=self.input_key, frames_sha256=frames_sha256(frames),
            video_sha256=hashlib.sha256(video).hexdigest(),
            timings={
                "queued_s": round(self.started - sent_at, 4) if sent_at else None,
                "inference_s": round(self.inference_s, 4),
                "dit_s": round(cost.dit_s, 4) if cost.dit_s is not None else None,
                "encode_s": round(encoded - encoding, 4),
                "total_s": round(time.time() - self.started, 4),
            },
            dit_flops=cost.dit_flops, peak_memory_gib=cost.peak_memory_gib,
            served=pipeline.served(self.req), execution=str(self.token),
            redelivered=bool(self.context.delivery_info.get("redelivered")))

    def finish(self, frames: np.ndarray) -> None:
        """In the finisher thread (finisher.py), while the replica computes its next request: encode and store the
        video, then answer the request as Celery would have, had the task returned or raised: its result (or
        failure) record, its `failed` webhook event, its task event for Flower; last, acknowledge its message. A
        delivery that lost its fence exits the process here too (still_ours). An answer that cannot be written
        (Redis gone for longer than REPLICADP_REDIS_OUTAGE) ends the process, so that the message goes back to
        the queue: acknowledged, the request would have no answer."""
        me, failure = child.current(), None
        try:
            try:
                stored = self.store(*self.encode(frames))
                self.tell(Event.COMPLETED, result=stored)
            finally:
                self.let_go()
                me.reporter.flush()  # its progress records are written before its answer
        except Exception as exc:
            failure = exc
            log.error("request %s failed: %r", self.request_id, exc, exc_info=not isinstance(exc, ReplicaDPError))
        try:
            if failure is None:
                generate.backend.mark_as_done(self.context.id, stored, request=self.context)
                me.finisher.send_event("task-succeeded", uuid=self.context.id, result=saferepr(stored),
                                       runtime=time.time() - self.started)
            else:
                generate.backend.mark_as_failure(self.context.id, failure, request=self.context)
                signals.task_failure.send(sender=generate, task_id=self.context.id, exception=failure, args=(),
                                          kwargs=self.context.kwargs, traceback=None, einfo=None)
                me.finisher.send_event("task-failed", uuid=self.context.id, exception=saferepr(failure))
            # Kept across a failover: the lease thread holds the message for as long as its unacked record
            # stays and this process lives, so a lost acknowledgement would hold it there for good.
            replication.durable(me.redis, lambda: me.acknowledge(self.context.properties["delivery_tag"]),
                                f"request {self.request_id}'s acknowledgement")
        except Exception:
            log.exception("request %s: cannot write its answer; the pool child exits, the request is requeued",
                          self.request_id)
            os._exit(EXIT_UNANSWERED)

    def store(self, video: bytes, result: Result) -> Result:
        """Store the video and its Result unless another delivery stored first; the stored Result."""
        me = child.current()
        self.report(Phase.STORING)
        # Ask Redis itself, once more, before the write: decoding and encoding checked neither fence nor cancel.
        answer = lease.acquire_unless(me.redis, self.fence, self.token, SETTINGS.lease_s,
                                      CANCEL_KEY + self.context.id)
        if answer.state == FenceState.CANCELLED:
            raise RequestCancelled(f"request {self.context.id} was cancelled after its last step; its video "
                                   "was not stored")
        self.still_ours(answer)

        def put() -> tuple[Result, bool]:
            stored = me.store.put(self.request_id, video, result)  # the first to store wins: this one, or another
            return stored, me.record_completion(self.request_id, self.context.id, self.fence, self.token)
        # A failover keeps the stored result (REPLICADP_STORE=redis) and the completion: a redelivery returns it.
        stored, cancelled = replication.durable(me.redis, put, f"request {self.request_id}'s result")
        self.released = not cancelled
        if cancelled:  # while it stored: nobody wants it
            me.store.delete(self.request_id)
            raise RequestCancelled(f"request {self.context.id} was cancelled as its video was stored; the "
                                   "video was removed")
        if stored["execution"] != result["execution"]:  # another delivery computed it too
            me.redis.hincrby(STATS_KEY, "duplicate_executions", 1)
        return stored
