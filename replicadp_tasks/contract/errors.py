"""The errors replicadp raises, and what each one fails: the request or the process. Two endings of a delivery that
are no error live with the replica (replica/outcomes.py: Parked, Finishing), and the failure of a write that a
failover could lose with Redis's clients (cluster/replication.py: NotReplicated)."""

NOTHING = object()  # no value given (None is a value a request can carry)


def shown(value) -> str:
    """A refused value as an error message shows it: its repr, cut at 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class ReplicaDPError(Exception):
    """Base of every replicadp error."""


class InvalidRequest(ReplicaDPError, ValueError):
    """Raised when a generate argument fails validation; the message names the field and the value, and so do
    `.field` and `.value` (the value as the message shows it: its repr, cut at 80 characters).

    Fails the request (state FAILURE, never retried); the replica keeps serving.
    """

    def __init__(self, message: str, field: str, value: str | None = None):
        # All three in args: Celery's JSON result backend rebuilds a failure as cls(*args).
        super().__init__(message, field, value)
        self.field, self.value = field, value

    def __str__(self) -> str:
        return self.args[0]

    @classmethod
    def of(cls, field: str, why: str, value=NOTHING):
        """`field=value: why` (or `field: why` without a value)."""
        if value is NOTHING:
            return cls(f"{field}: {why}", field)
        return cls(f"{field}={shown(value)}: {why}", field, shown(value))


class RequestIdConflict(InvalidRequest):
    """Raised when a request_id already holds a result made from different inputs.

    Fails the request: reusing an idempotency key for new inputs would hand back someone else's video.
    """


class ImageInputError(InvalidRequest):
    """Raised when the `image` argument cannot be fetched or decoded into a first frame.

    Fails the request.
    """


class FetchError(InvalidRequest):
    """Raised when a URL a request carries cannot be fetched: refused by the fetch policy (a scheme other than
    http(s), an address that is not public and not in REPLICADP_FETCH_ALLOW, too many redirects), over its byte
    or time limit, an HTTP status other than 2xx, or no valid HTTP response. The message never repeats what the
    remote side answered.

    Fails the request. (For `image`, it reaches the caller as ImageInputError with the same message.)
    """


class PoisonRequest(ReplicaDPError):
    """Raised when a request has already started REPLICADP_MAX_ATTEMPTS times: each earlier attempt ended
    its replica's process (an OOM kill, a CUDA crash), so running it again would only kill another one.

    Fails the request, which is recorded as dead (`replicadp:dead`); the replicas keep serving.
    """


class RequestCancelled(ReplicaDPError):
    """Raised when a request's caller cancelled it (`client.api.cancel_request`): checked before it starts, at
    every denoising step (as the fence keeper heard it: at once, or within a second) and before it stores.

    Fails the request; the replica keeps its model and takes the next one.
    """


class RequestPreempted(ReplicaDPError):
    """Raised when a running request is stopped at a step boundary so that a request of a higher priority runs
    first (`client.api.preempt_request`, or the deployment's preemption policy).

    Fails nothing: its state at that step is saved, it goes back to the head of its priority list, and the replica
    that takes it next goes on from that step (model/checkpoint.py); the attempt is not counted.
    """


class OutOfMemory(ReplicaDPError):
    """Raised when a request needs more device (or host) memory than the replica has left.

    Fails the request; the replica frees what the request held and keeps serving smaller ones.
    """


class ModelLoadError(ReplicaDPError):
    """Raised when a replica cannot load its model (bad spec, missing folder, no weights).

    Fails the process: the replica exits and its supervisor reports or restarts it.
    """


class StoreError(ReplicaDPError):
    """Raised when the output store cannot write or read a video.

    Fails the request.
    """


class MessageRefused(ReplicaDPError):
    """Raised when a message on a replica's queue is not a request it serves (not a JSON object, wrong or unknown
    headers, an eta, callbacks, past a size bound): checked in the replica's main process before Celery reads it.

    Fails the request when the message names one (a FAILURE result under its task id); the message is
    acknowledged and recorded as dead (`replicadp:dead`), and the replica keeps serving.
    """

    def __init__(self, reason: str, task_id: str | None = None):
        super().__init__(reason)
        self.task_id = task_id


class GroupLost(ReplicaDPError):
    """Raised when a rank of a multi-process replica (REPLICADP_PARALLEL, parallel.py) died, hung past
    REPLICADP_PARALLEL_TIMEOUT or failed mid-request: the replica's attempt ends (its process exits and the request
    is requeued, as a killed replica's is) and the pool's next child rebuilds the group."""


class RedisURLError(ReplicaDPError, ValueError):
    """Raised when the Redis URL cannot be used (a Sentinel URL without its master's name, an unknown query
    parameter, a bad port or database); the message names REDIS_URL and shows the URL without its passwords.

    Fails the process at start (settings.py turns it into its exit message).
    """
