"""The shapes that cross a process or the wire: the fence's token, the size parser, InvalidRequest's field and
value through Celery's JSON result backend, and imports without side effects."""

import subprocess
import sys

import pytest

from replicadp_tasks import app
from replicadp_tasks.contract import REFERENCE_SIZE, ImageInputError, InvalidRequest, parse_size
from replicadp_tasks.contract.keys import FenceToken


@pytest.mark.parametrize("replica", ["replica0@host", "replica:with:colons@host"])
def test_fence_token_round_trips(replica):
    """A token read back from Redis names the same replica, pool child and delivery."""
    token = FenceToken(replica, 4242, "4b1c8c1e-0000-4000-8000-000000000000")
    assert FenceToken.parse(str(token)) == token


@pytest.mark.parametrize("text, size", [("832x480", (832, 480)), ("64X32", (64, 32)), (REFERENCE_SIZE, (832, 480))])
def test_parse_size_reads_width_then_height(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["832", "832x", "x480", "0x480", "832x-4", "832by480", "8 32x480", "٨x٨", ""])
def test_parse_size_refuses_naming_the_field(text):
    """Anything but two positive decimal integers around an x is refused, naming the field and the value."""
    with pytest.raises(InvalidRequest) as err:
        parse_size(text, field="--size")
    assert err.value.field == "--size" and err.value.value == repr(text)
    assert str(err.value) == f"--size={text!r}: expected WIDTHxHEIGHT, e.g. 832x480"


@pytest.mark.parametrize("exc", [InvalidRequest.of("width", "must be a multiple of 32", value=48),
                                 ImageInputError.of("image", "cannot decode"),
                                 InvalidRequest.of("prompt", "too long", value="x" * 500)])
def test_invalid_request_keeps_field_and_value_through_the_result_backend(exc):
    """Celery's JSON backend stores a failure as its type and args and rebuilds it as cls(*args): the field, the
    value and the message come back as they left the replica."""
    stored = app.backend.prepare_exception(exc)
    back = app.backend.exception_to_python(stored)
    assert type(back) is type(exc)
    assert (str(back), back.field, back.value) == (str(exc), exc.field, exc.value)
    assert len(str(back)) < 120  # a long value is cut in the message and in .value alike


def test_producer_imports_start_no_replica_machinery():
    """Importing the producer side (the task, the API, the key schema) connects no replica signal handler or
    bootstep and imports no torch: worker.py is imported by `celery worker` alone."""
    code = ("import sys, client.api, replicadp_tasks, replicadp_tasks.contract.keys; "
            "bad = [m for m in ('replicadp_tasks.worker', 'torch', 'diffusers') if m in sys.modules]; "
            "sys.exit(' '.join(bad) or None)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
