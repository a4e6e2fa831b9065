"""Pieces tested alone: validation, the output store, bit-exact encoding, the batch file reader."""

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from client.submit import BatchFileError, read_batch
from replicadp_tasks.contract import DEFAULTS, Accepts, InvalidRequest, input_key, validate_request
from replicadp_tasks.outputs import decode_mp4, encode_mp4, fetch_video, frames_sha256
from replicadp_tasks.outputs.store import DirStore, RedisStore


def test_defaults_are_the_reference_workload():
    """Without arguments beyond the prompt, a request is vllm-omni's reference: 832x480, 33 frames, 30 steps."""
    req = validate_request({"prompt": "x"}, Accepts(size_multiple=32))
    assert (req.width, req.height, req.num_frames, req.num_inference_steps) == (832, 480, 33, 30)
    assert req.seed == DEFAULTS["seed"]


@pytest.mark.parametrize("field, value, message", [
    ("height", 480.0, "height=480.0: must be an integer"),
    ("height", True, "height=True: must be an integer"),
    ("width", "832", "width='832': must be an integer"),
    ("width", -32, "width=-32: must be between"),
    ("height", 10**9, "must be between"),
    ("num_frames", 32, "num_frames=32: must be of the form 4k\\+1"),
    ("guidance_scale", float("inf"), "guidance_scale=inf: must be a finite number"),
    ("guidance_scale", 25, "guidance_scale=25: must be between 0.0 and 20.0"),
    ("num_inference_steps", 201, "num_inference_steps=201"),
    ("seed", -1, "seed=-1"),
    ("prompt", "", "prompt='': must not be empty"),
    ("prompt", "a\x00b", r"control character .\\x00. at position 1"),
    ("negative_prompt", "ok\x1b[31m", r"control character .\\x1b. at position 2"),
    ("prompt", "x" * 5000, "is 5000 characters long; the limit is 4000"),
    ("request_id", "../../etc/passwd", "request_id='../../etc/passwd'"),
    ("request_id", "a/b", "request_id='a/b'"),
    ("request_id", "x" * 129, "request_id="),
    ("image", 5, "image=5"),
    ("steps", 30, "steps=30: unknown argument"),
])
def test_validation_names_field_and_value(field, value, message):
    """Every bad value is refused with an error naming the field and the value; nothing is rounded."""
    with pytest.raises(InvalidRequest, match=message):
        validate_request({"prompt": "a fox", field: value}, Accepts(size_multiple=32))


def test_missing_prompt_and_unicode_prompt():
    """The prompt is required; any Unicode is accepted as is."""
    with pytest.raises(InvalidRequest, match="prompt=None: is required"):
        validate_request({}, Accepts(size_multiple=16))
    assert validate_request({"prompt": "狐狸 🦊 в снегу"}).prompt == "狐狸 🦊 в снегу"


def test_input_key_covers_every_output_changing_input():
    """Two inputs that differ in any output-changing field, in the model, or in what of the deployment changes
    the output (a fast request's step cache, a quantized transformer) have different keys."""
    base = validate_request({"prompt": "x"}).params()
    keys = {input_key(base, "tiny"), input_key(base, "other"), input_key(base, "tiny", {"quantize": "fp8"})}
    for field, value in [("seed", 1), ("height", 64), ("num_frames", 9), ("guidance_scale", 1.0),
                         ("negative_prompt", "blur"), ("max_sequence_length", 64), ("fps", 16),
                         ("image_sha256", "ab"), ("quality", "fast")]:
        keys.add(input_key({**base, field: value}, "tiny"))
    fast = {**base, "quality": "fast"}
    keys |= {input_key(fast, "tiny", {"cache": "mag threshold=0.06"}), input_key(fast, "tiny", {"cache": "pab interval=2"})}
    assert len(keys) == 14
    assert input_key(base, "tiny", {}) == input_key(base, "tiny")  # the exact path's key needs no `served`


def test_negative_zero_is_zero_in_a_requests_identity():
    """-0.0 and 0.0 compute the same frames, so they are one input: the same params and input key (had been: two
    keys, and a request_id reused across them was a RequestIdConflict)."""
    for field in ("guidance_scale", "guidance_scale_2", "boundary_ratio"):
        minus, plus = (validate_request({"prompt": "x", field: zero}).params() for zero in (-0.0, 0.0))
        assert minus == plus and str(minus[field]) == "0.0", field
        assert input_key(minus, "tiny") == input_key(plus, "tiny"), field


def test_dir_store_first_writer_wins(tmp_path):
    """Two deliveries of one request_id: the first stored result stays and is what both get back."""
    store = DirStore(tmp_path)
    first = store.put("r1", b"first", {"n": 1})
    second = store.put("r1", b"second", {"n": 2})
    assert first == second == store.get_meta("r1")
    assert first["n"] == 1 and fetch_video(first["video_uri"], "") == b"first"
    named = first["video_uri"].rsplit("/", 1)[1]
    # No temp files left.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["r1.json", named])


def test_encoding_is_bit_exact_and_decodes_to_the_frames():
    """The same frames always give the same MP4 bytes; they decode to the same shape, close in value."""
    y, x = np.mgrid[0:32, 0:48]
    frame = np.stack([x * 5, y * 7, (x + y) * 3], axis=-1).astype(np.uint8)  # smooth: H.264 keeps it close
    frames = np.stack([np.roll(frame, t, axis=1) for t in range(5)])
    a, b = encode_mp4(frames, 24), encode_mp4(frames, 24)
    assert a == b
    decoded = decode_mp4(a)
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(int) - frames.astype(int)).mean() < 8
    assert frames_sha256(frames) != frames_sha256(frames.reshape(5, 48, 32, 3))


def test_batch_file_reports_every_bad_line_with_its_number(tmp_path):
    """A malformed JSONL file is refused as a whole, listing each bad line by number."""
    f = tmp_path / "batch.jsonl"
    f.write_text('{"prompt": "ok"}\nnot json\n{"prompt": "x", "height": 33}\n[1]\n{"prompt": "fine", "seed": 2}\n')
    with pytest.raises(BatchFileError) as err:
        read_batch(f)
    text = str(err.value)
    assert "line 2: not JSON" in text and "line 3: height=33" in text and "line 4: expected a JSON object" in text
    assert "\nline 1:" not in text and "\nline 5:" not in text


def test_batch_file_ids_are_stable(tmp_path):
    """Plain text is one prompt per line; lines without a request_id get the same id on every read."""
    f = tmp_path / "prompts.txt"
    f.write_text("a fox\n\na whale\n")
    first, again = read_batch(f), read_batch(f)
    assert [n for n, _ in first] == [1, 3]
    assert [kw["request_id"] for _, kw in first] == [kw["request_id"] for _, kw in again]
    assert first[0][1]["prompt"] == "a fox"
    j = tmp_path / "b.jsonl"
    j.write_text(json.dumps({"prompt": "x", "request_id": "mine"}) + "\n")
    assert read_batch(j)[0][1]["request_id"] == "mine"


def test_importing_the_worker_package_loads_no_torch():
    """A replica's main process imports replicadp_tasks before forking its pool child: torch (and with it
    CUDA) must stay out of it, or the child could not use the GPU."""
    code = "import sys, replicadp_tasks, client.cli; sys.exit('torch' in sys.modules or 'diffusers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_redis_store_first_writer_wins_and_fetches(redis_server):
    """The Redis store (for hosts without a shared disk) keeps the first result under a TTL, and
    fetch_video reads the bytes back from its video_uri."""
    import redis

    store = RedisStore(redis.Redis.from_url(redis_server.url), ttl_s=60)
    rid = f"redis-store-{uuid.uuid4().hex}"
    first = store.put(rid, b"mp4 bytes", {"n": 1})
    assert store.put(rid, b"other", {"n": 2}) == first == store.get_meta(rid)
    assert fetch_video(first["video_uri"], redis_server.url) == b"mp4 bytes"
    assert 0 < redis.Redis.from_url(redis_server.url).ttl(first["video_uri"].split(":", 1)[1]) <= 60


@pytest.mark.parametrize("env, message", [
    ({"NUM_REPLICAS": "2", "DEVICES": "0,1,2"}, "DEVICES=0,1,2 lists 3 GPU(s); NUM_REPLICAS=2 x GPUS_PER_REPLICA=1 needs 2"),
    ({"NUM_REPLICAS": "2", "DEVICES": "0,1", "GPUS_PER_REPLICA": "2"}, "needs 4"),
    ({"NUM_REPLICAS": "2", "DEVICES": "0,0"}, "lists GPU 0 more than once"),
    ({"NUM_REPLICAS": "1", "DEVICES": "gpu0"}, "'gpu0' is not a GPU index"),
    ({"NUM_REPLICAS": "zero"}, "NUM_REPLICAS=zero: must be a positive integer"),
])
def test_worker_launch_checks_devices_against_counts(env, message):
    """worker_launch.sh refuses a device list that does not fit the replica counts, with a clear message,
    before starting anything."""
    run = subprocess.run(["bash", str(Path(__file__).parent.parent / "worker_launch.sh")],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and message in run.stderr


def test_worker_launch_lets_replicas_share_a_gpu_when_asked():
    """SHARE_GPUS=1 accepts a GPU listed twice (two replicas on one GPU, as scripts/gpu_check.sh runs them) and
    starts both replicas on it (here `true` stands in for celery)."""
    env = {**os.environ, "NUM_REPLICAS": "2", "DEVICES": "0,0", "SHARE_GPUS": "1", "CELERY": "true"}
    proc = subprocess.Popen(["bash", str(Path(__file__).parent.parent / "worker_launch.sh")], env=env,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = [proc.stderr.readline() for _ in range(3)]  # restarts of `true` may come first
        assert any("started 2 supervised replica(s) on DEVICES=0,0" in line for line in lines), lines
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_worker_side_imports_nothing_of_the_client_side():
    """No module of replicadp_tasks (nor celeryconfig.py), at its top or inside a function, imports the `client`
    package: a replica must run without the producer side (and its imports) in its processes."""
    import ast

    root = Path(__file__).parent.parent
    found = []
    for path in [*sorted((root / "replicadp_tasks").rglob("*.py")), root / "celeryconfig.py"]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "client"]
    assert not found, found
