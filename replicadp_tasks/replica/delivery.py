"""One delivery of one request to a pool child: what it asks for, who computes it, and each step from its
validation to its answer. `generate` (tasks.py) runs the steps up to the frames; the finisher thread runs
`finish` (finisher.py).

Delivery is at least once, a result is made once: a request that already has a result gets it back, and only the
delivery that holds the request's fence computes (leases.py); a delivery that finds the fence another's is
parked, and returns that one's result when it comes back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
from celery import signals
from celery.utils.saferepr import saferepr

from ..cluster import fence, replication
from ..cluster.fence import FenceAnswer, FenceState
from ..contract.errors import GroupLost, ReplicaDPError, RequestCancelled, RequestIdConflict, RequestPreempted
from ..contract.keys import (ATTEMPTS_KEY, CANCEL_KEY, CHECKPOINT_KEY, PREEMPT_KEY, PREEMPTIONS_KEY, STATS_KEY,
                             FenceToken, fence_key)
from ..contract.models import check_served
from ..contract.records import Phase, Progress, RequestState, Result
from ..contract.request import GenerateRequest, input_key, validate_request
from ..contract.webhook import Event
from ..inputs.images import load_first_frame
from ..model.checkpoint import Checkpoint
from ..model.pipeline import describe_device
from ..outputs.video import encode_mp4, frames_sha256
from ..settings import SETTINGS
from ..webhooks import check_allowed, emit
from . import child
from .outcomes import Exit, Finishing, Parked, Preempted, exit_process

log = logging.getLogger("replicadp")
# PROGRESS within a phase at most this often (the first step and each change of phase always): each is a write of
# the result key (by the reporter thread, off the request's path, but a write Redis fsyncs); a person, `status` and
# `health` need no more.
PROGRESS_EVERY_S = 0.5


@dataclass
class Delivery:
    """One delivery of one request to this pool child: what it asks for and who computes it."""

    task: object  # the `generate` task: its result backend answers the request
    context: object  # Celery's request context of this delivery (`task.request` moves on to the next request)
    req: GenerateRequest
    image: object  # the first frame (PIL), or None
    params: dict  # the effective inputs, as reported back
    served: dict  # what of the deployment changes its output besides the inputs (PipelineHolder.served)
    input_key: str
    request_id: str  # the caller's, else the task id
    token: FenceToken
    started: float
    reported: float = 0.0  # when Progress was last written (monotonic)
    phase: Phase | None = None  # the phase last reported, since phase_started_at (unix time)
    phase_started_at: float = 0.0
    step: int = 0  # the denoising step last reached, of total_steps
    total_steps: int = 0
    first_step: int = 0  # the step it goes on from, where it was preempted before
    released: bool = False  # its fence, with the completion's record (store)
    inference_s: float = 0.0  # how long compute() took
    cost: object = None  # the pipeline's RunStats of this request

    @classmethod
    def of(cls, task, kwargs: dict, started: float) -> "Delivery":
        """Validate `kwargs` for the loaded model (InvalidRequest names the field), which it must name if it names
        one, check its webhook against this deployment's policy, and load its first frame."""
        me = child.current()
        check_served(kwargs.get("model"), SETTINGS.served_model_name)
        req = validate_request(kwargs, me.pipeline.accepts, max_prompt_chars=SETTINGS.max_prompt_chars,
                               max_work=SETTINGS.max_work)
        check_allowed(req.webhook)
        image, image_sha256 = None, None
        if req.image is not None:
            image, image_sha256 = load_first_frame(
                req.image, req.width, req.height, max_bytes=SETTINGS.max_image_bytes,
                timeout_s=SETTINGS.image_timeout_s, image_dir=SETTINGS.image_dir, allow_nets=SETTINGS.fetch_allow,
                cancelled=lambda: me.cancelled(task.request.id))
        params, served = req.params(image_sha256), me.pipeline.served(req)
        return cls(task=task, context=task.request, req=req, image=image, params=params, served=served,
                   input_key=input_key(params, SETTINGS.model, served), request_id=req.request_id or task.request.id,
                   token=FenceToken(task.request.hostname, os.getpid(), task.request.id), started=started)

    @property
    def fence(self) -> str:
        return fence_key(self.request_id)

    def take_fence(self) -> Result | None:
        """Hold this request's fence and return None; or return the stored result, if one exists. If another
        live delivery holds the fence, raise Parked: this replica need not wait for that one's result, and its
        message waits in Redis for the fence to be free (leases.Keeper.park); this start is not counted."""
        me = child.current()
        # A failover keeps the fence: no second delivery computes meanwhile.
        answer = replication.durable(me.redis, lambda: fence.acquire(me.redis, self.fence, self.token,
                                                                      SETTINGS.lease_s),
                                     f"request {self.request_id}'s fence", SETTINGS.durability)
        done = me.store.get_meta(self.request_id)  # after the fence: a result stored just before counts
        if done is not None:
            if answer.ours:
                fence.release(me.redis, self.fence, self.token)
            if done["input_key"] != self.input_key:
                raise RequestIdConflict.of("request_id", "already used for different inputs", value=self.request_id)
            return {**done, "redelivered": True}
        if answer.ours:
            return None
        me.uncount_attempt(self.context.id)
        raise Parked(f"request {self.request_id} is being computed by {answer.owner}; parked until its fence is free")

    def compute(self, saved: dict) -> np.ndarray:
        """Denoise and decode: the frames, from the step a preemption stopped it at, where one did (`saved`: its
        checkpoint's hash, as PoolChild.start_attempt read it). From here the
        fence keeper keeps the fence and hears a cancel or a preemption; a broken group of ranks ends the process,
        not the request (it is requeued as a killed replica's is, and the pool's next child rebuilds the group). On
        any failure, and on a preemption, the fence is let go here; else the finish does."""
        me = child.current()
        me.fences.watch(self.fence, self.token)
        try:
            self.tell(Event.STARTED)
            me.finisher.computes()  # the request before it, if waiting, is finished meanwhile
            resume = self.checkpoint(saved)
            self.first_step = resume.step if resume is not None else 0
            inference_started = time.time()
            try:
                frames = me.pipeline.generate(self.req, self.image, on_step=self.on_step, resume=resume)
            except GroupLost as exc:
                exit_process(Exit.GROUP_LOST, f"request {self.request_id}: {exc}")
            except RequestPreempted as exc:
                raise self.preempted(exc) from None
            self.inference_s, self.cost = time.time() - inference_started, me.pipeline.last_run
            return frames
        except BaseException as exc:
            self.let_go(preempted=isinstance(exc, Preempted))
            raise

    def checkpoint(self, saved: dict) -> Checkpoint | None:
        """Where an earlier delivery of this request stopped when it was preempted (model/checkpoint.py), from its
        `saved` hash, if it saved its state for these very inputs; None: from the first step. A checkpoint that
        cannot be read is logged and left: the request starts again, nothing is lost but time."""
        if not saved or saved.get(b"input_key", b"").decode() != self.input_key:
            return None
        try:
            resume = Checkpoint.from_bytes(saved[b"data"])
        except Exception as exc:
            log.error("request %s: its checkpoint cannot be read (%r); it starts from the first step",
                      self.request_id, exc)
            return None
        log.info("request %s goes on from step %d of %d, where it was preempted", self.request_id, resume.step,
                 resume.total)
        return resume

    def preempted(self, exc: RequestPreempted) -> Preempted:
        """The request stopped at a step boundary for one of a higher priority: save its state there (none where
        its path cannot go on exactly: it starts again), take back this start's count and the preemption asked
        for, count the preemption, say so (Progress, webhook); the Preempted outcome that requeues it at the head
        of its priority list. Its fence is let go by compute, after the state is saved."""
        me, task_id, ck = child.current(), self.context.id, exc.checkpoint

        def save() -> None:
            pipe = me.redis.pipeline()
            if ck is not None:
                pipe.hset(CHECKPOINT_KEY + self.request_id, mapping={
                    "input_key": self.input_key, "step": ck.step, "total": ck.total, "data": ck.to_bytes()})
                pipe.expire(CHECKPOINT_KEY + self.request_id, SETTINGS.result_ttl_s)
            pipe.delete(PREEMPT_KEY + task_id)
            pipe.incr(PREEMPTIONS_KEY + task_id)
            pipe.expire(PREEMPTIONS_KEY + task_id, SETTINGS.result_ttl_s)
            pipe.decr(ATTEMPTS_KEY + task_id)  # not a failed attempt
            pipe.execute()
        replication.durable(me.redis, save, f"request {self.request_id}'s checkpoint", SETTINGS.durability)
        me.fences.forget(task_id)
        self.report(Phase.PREEMPTED)
        me.reporter.flush()  # written before the request is queued again: the next start's records come after
        self.tell(Event.PREEMPTED, step=self.step, total_steps=self.total_steps)
        where = f"at step {self.step} of {self.total_steps}"
        return Preempted(f"request {self.request_id} was preempted {where}; queued again, to go on "
                         + (f"from step {ck.step}" if ck is not None else "from its first step (its path cannot "
                                                                          "resume exactly)"))

    def hand_to_finisher(self, frames: np.ndarray) -> Finishing:
        """Have the finisher thread encode, store and answer the request once the one before it there is done
        (`finish`); meanwhile this replica takes its next request. Returns the Finishing that `generate` raises
        (outcomes.py)."""
        child.current().finisher.submit(lambda: self.finish(frames), self.context.id, self.request_id)
        return Finishing(f"request {self.request_id}: frames computed; the finisher encodes, stores and answers it")

    def let_go(self, preempted: bool = False) -> None:
        """The request has ended here: stop keeping its fence, and release it unless the completion's record did;
        unless it was `preempted` (to go on later), forget where an earlier preemption stopped it: it failed, or
        was cancelled, and its checkpoint would wait in Redis for nothing."""
        me = child.current()
        me.fences.unwatch(self.token)
        if not self.released:
            pipe = me.redis.pipeline(transaction=False)
            fence.release(pipe, self.fence, self.token)
            if not preempted:
                pipe.delete(CHECKPOINT_KEY + self.request_id)
            pipe.execute()

    def check_fence(self, cancelled: str) -> None:
        """Ask Redis whether the request was cancelled (RequestCancelled: it `cancelled`, e.g. "at step 3 of 8")
        and whether this delivery still holds its fence (still_ours)."""
        me = child.current()
        answer = fence.acquire_unless(me.redis, self.fence, self.token, SETTINGS.lease_s, CANCEL_KEY + self.context.id)
        if answer.state == FenceState.CANCELLED:
            raise RequestCancelled(f"request {self.context.id} was cancelled {cancelled}")
        self.still_ours(answer)

    def check_preempted(self, step: int, total: int) -> None:
        """RequestPreempted if a preemption of this request was asked for (PREEMPT_KEY: from a step it has
        reached) and it has been preempted fewer than REPLICADP_MAX_PREEMPTIONS times; past that, the ask is
        dropped and it runs to its end. Never at its last step: its frames are as good as done."""
        me, task_id = child.current(), self.context.id
        if step == total:
            return
        asked, count = me.redis.pipeline(transaction=False).get(PREEMPT_KEY + task_id).get(
            PREEMPTIONS_KEY + task_id).execute()
        if asked is None or step < int(asked):
            return
        if int(count or 0) >= SETTINGS.max_preemptions:
            me.redis.delete(PREEMPT_KEY + task_id)
            log.info("request %s: preempted %s times already (REPLICADP_MAX_PREEMPTIONS); it runs to its end",
                     self.request_id, int(count))
            return
        raise RequestPreempted(f"request {task_id} was preempted at step {step} of {total}")

    def still_ours(self, answer: FenceAnswer) -> None:
        """Exit the process unless this delivery still holds the fence. A Redis restart may have expired it (then
        it is ACQUIRED again); if another delivery holds it, or held it and stored the result, this one was
        presumed dead (its replica stopped for longer than a lease). Exit, not raise: the message is requeued,
        not acknowledged, as the shared delivery tag would acknowledge the other delivery's message."""
        if answer.state == FenceState.ACQUIRED and child.current().store.get_meta(self.request_id) is not None:
            answer = FenceAnswer(FenceState.TAKEN, "a delivery that stored its result")
        if not answer.ours:
            exit_process(Exit.FENCED_OUT, f"request {self.request_id}: fence taken by {answer.owner}; this delivery "
                                          "stops")

    def on_step(self, step: int, total: int) -> None:
        """At every denoising step: stop if cancelled, fenced out or preempted; report Progress now and then. The
        fence keeper's last look answers, when it found all well within two ticks; else Redis does."""
        self.step, self.total_steps = step, total
        if not child.current().fences.clear(self.token):
            self.check_fence(f"at step {step} of {total}")
            self.check_preempted(step, total)
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
            first_step=self.first_step, replica=self.token.replica, request_id=self.request_id, pid=self.token.pid),
            self.context)

    def tell(self, event: Event, **fields) -> None:
        """Queue a webhook event of this request, if it asks for it: a Redis write, never a wait on the receiver
        (the replica's main process sends it)."""
        emit(child.current().redis, self.req.webhook, event, task_id=self.context.id, request_id=self.request_id,
             replica=self.token.replica, **fields)

    def finish(self, frames: np.ndarray) -> None:
        """In the finisher thread, while the replica computes its next request: encode and store the video, then
        answer the request as Celery would have, had the task returned or raised (answer). A delivery that lost
        its fence exits the process here too (still_ours)."""
        me, failure, stored = child.current(), None, None
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
        self.answer(stored, failure)

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
            model=SETTINGS.served_model_name, params=self.params, input_key=self.input_key,
            frames_sha256=frames_sha256(frames),
            video_sha256=hashlib.sha256(video).hexdigest(),
            timings={
                "queued_s": round(self.started - sent_at, 4) if sent_at else None,
                "inference_s": round(self.inference_s, 4),
                "dit_s": round(cost.dit_s, 4) if cost.dit_s is not None else None,
                "encode_s": round(encoded - encoding, 4),
                "total_s": round(time.time() - self.started, 4),
            },
            dit_flops=cost.dit_flops, peak_memory_gib=cost.peak_memory_gib, served=self.served,
            execution=str(self.token), redelivered=bool(self.context.delivery_info.get("redelivered")))

    def store(self, video: bytes, result: Result) -> Result:
        """Store the video and its Result unless another delivery stored first; the stored Result."""
        me = child.current()
        self.report(Phase.STORING)
        # Ask Redis itself, once more, before the write: decoding and encoding checked neither fence nor cancel.
        self.check_fence("after its last step; its video was not stored")

        def put() -> tuple[Result, bool]:
            stored = me.store.put(self.request_id, video, result)  # the first to store wins: this one, or another
            return stored, me.record_completion(self.request_id, self.context.id, self.fence, self.token)
        # A failover keeps the stored result (REPLICADP_STORE=redis) and the completion: a redelivery returns it.
        stored, cancelled = replication.durable(me.redis, put, f"request {self.request_id}'s result",
                                                SETTINGS.durability)
        self.released = not cancelled
        if cancelled:  # while it stored: nobody wants it
            me.store.delete(self.request_id)
            raise RequestCancelled(f"request {self.context.id} was cancelled as its video was stored; the "
                                   "video was removed")
        if stored["execution"] != result["execution"]:  # another delivery computed it too
            me.redis.hincrby(STATS_KEY, "duplicate_executions", 1)
        return stored

    def answer(self, stored: Result | None, failure: Exception | None) -> None:
        """From the finisher: the request's result (or failure) record, its `failed` webhook event, its task event
        for Flower; last, acknowledge its message. An answer that cannot be written (Redis gone for longer than
        REPLICADP_REDIS_OUTAGE) ends the process, so that the message goes back to the queue: acknowledged, the
        request would have no answer."""
        me = child.current()
        try:
            if failure is None:
                self.task.backend.mark_as_done(self.context.id, stored, request=self.context)
                me.finisher.send_event("task-succeeded", uuid=self.context.id, result=saferepr(stored),
                                       runtime=time.time() - self.started)
            else:
                self.task.backend.mark_as_failure(self.context.id, failure, request=self.context)
                signals.task_failure.send(sender=self.task, task_id=self.context.id, exception=failure, args=(),
                                          kwargs=self.context.kwargs, traceback=None, einfo=None)
                me.finisher.send_event("task-failed", uuid=self.context.id, exception=saferepr(failure))
            # Kept across a failover: the lease thread holds the message for as long as its unacked record
            # stays and this process lives, so a lost acknowledgement would hold it there for good.
            replication.durable(me.redis, lambda: me.acknowledge(self.context.properties["delivery_tag"]),
                                f"request {self.request_id}'s acknowledgement", SETTINGS.durability)
        except Exception:
            log.exception("request %s: cannot write its answer", self.request_id)
            exit_process(Exit.UNANSWERED, f"request {self.request_id}: its answer was not written")
