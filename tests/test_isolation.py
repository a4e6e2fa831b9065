"""Isolation that holds in any process: the same frames give the same MP4 bytes whatever the heap holds, the
same input gives the same frames in every replica (on the machine's own instruction set and on AVX2 forced),
and the isolation check tells numeric noise from bleed."""

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from client.api import Outcome
from client.bench.isolation import check_baseline, describe_mismatch, write_baseline
from client.bench.run import PROMPTS
from conftest import start_replicas
from helpers import AVX2
from replicadp_tasks.outputs import decode_mp4, encode_mp4, frames_sha256

REPLICADP = str(Path(sys.executable).parent / "replicadp")
SMALL = ["--size", "64x64", "--num-frames", "9", "--steps", "4"]


def video_frames(seed: int, height: int, width: int, count: int = 9) -> np.ndarray:
    """A smooth random video (blocks of 8x8 pixels plus noise): something x264 has to work at."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (count, height // 8, width // 8, 3)).repeat(8, 1).repeat(8, 2)
    return (blocks + rng.integers(-12, 12, blocks.shape)).clip(0, 255).astype(np.uint8)


def python(code: str, env: dict | None = None, *args: str) -> str:
    run = subprocess.run([sys.executable, "-c", code, *args], env={**os.environ, **(env or {})},
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr
    return run.stdout


def save_frames(folder: Path, sizes) -> list[str]:
    """Videos of `sizes` (height, width) saved as .npy files for a process to encode; their paths."""
    paths = []
    for i, (height, width) in enumerate(sizes):
        paths.append(str(folder / f"{height}x{width}.npy"))
        np.save(paths[-1], video_frames(i, height, width, 9 if width < 256 else 5))
    return paths


ENCODE = """
import hashlib, sys
import numpy as np
from replicadp_tasks.outputs import video
if sys.argv[1] == "fallback":
    video.loaded_library = lambda name: None  # as where libx264 is no shared library this process can find
threads = int(sys.argv[2])
print(video.x264_params(threads))
for path in sys.argv[3:]:
    print(hashlib.sha256(video.encode_mp4(np.load(path), 24, threads=threads)).hexdigest())
"""


@pytest.mark.parametrize("mode,threads", [("detected", 1), ("fallback", 1), ("detected", 4)])
def test_the_same_frames_give_the_same_mp4_whatever_the_heap_holds(mode, threads, tmp_path):
    """Four processes whose new heap blocks hold four different bytes (glibc's MALLOC_PERTURB_, every block from
    the heap) encode the same frames at widths that are and are not multiples of 128: one MP4 per size. x264's
    AVX-512 macroblock-tree code reads heap memory it never wrote at such widths; without the cap in video.py
    this fails on an AVX-512 machine (measured: a digest per byte at 64x64, 192 and 832 wide). Both ways of
    encoding hold: x264's CPU detection less AVX-512, and mbtree=0 where libx264 cannot be found; and so do 4
    frame threads (a GPU replica's REPLICADP_ENCODE_THREADS), whose scheduling differs from run to run."""
    frames = save_frames(tmp_path, ((64, 64), (128, 192), (480, 832), (128, 256)))
    env = {"MALLOC_MMAP_THRESHOLD_": str(2**30)}
    runs = [python(ENCODE, {**env, "MALLOC_PERTURB_": byte}, mode, str(threads), *frames).split()
            for byte in ("0", "7", "91", "200")]
    assert all(len(r) == 5 for r in runs)
    assert all(r == runs[0] for r in runs), runs
    assert ("mbtree=0" if mode == "fallback" else ":asm=") in runs[0][0]
    assert runs[0][0].startswith(f"threads={threads}:")


def test_the_encoder_thread_count_changes_the_mp4_not_the_frames():
    """Why the count is a setting, never x264's own from the machine's cores: the same frames on 1 and on 4
    threads give other bytes, and both decode to frames of the same shape (the primary identity,
    frames_sha256, is of the pipeline's frames, not of the decoded MP4)."""
    frames = video_frames(3, 480, 832, 5)
    one, four = encode_mp4(frames, 24), encode_mp4(frames, 24, threads=4)
    assert one != four
    assert decode_mp4(one).shape == decode_mp4(four).shape == frames.shape


REPEAT = """
import hashlib, json, sys
from pathlib import Path
import numpy as np
from replicadp_tasks.contract import Accepts, validate_request
from replicadp_tasks.model import ModelOptions, PipelineHolder
from replicadp_tasks.outputs import encode_mp4

holder = PipelineHolder(ModelOptions("tiny", model_cache=Path(sys.argv[1])))
holder.load()
frames = {f.shape[1:3]: f for f in map(np.load, sys.argv[2:])}
digests = {str(k): set() for k in frames}
for i in range(100):
    # A real request between encodes, each with other inputs: the heap churns as in a replica.
    req = validate_request({"prompt": f"a fox {i}", "seed": i, "height": 64, "width": 64, "num_frames": 5,
                            "num_inference_steps": 2}, Accepts(size_multiple=holder.size_multiple), max_prompt_chars=4000,
                           max_work=10**12)
    holder.generate(req)
    for (height, width), f in frames.items():
        if width > 64 and i % 10:
            continue  # the large one every 10th time: it takes a while to encode
        # The same values from another buffer each time: offset by i bytes, or every other column of a wider one.
        if i % 2:
            raw = np.zeros(f.nbytes + i, np.uint8)
            buf = raw[i:i + f.nbytes].reshape(f.shape)
        else:
            buf = np.zeros((f.shape[0], height, 2 * width, 3), np.uint8)[:, :, ::2]
        buf[...] = f
        digests[str((height, width))].add(hashlib.sha256(encode_mp4(buf, 24)).hexdigest())
print(json.dumps({k: sorted(v) for k, v in digests.items()}))
"""


def test_the_same_frames_give_the_same_mp4_between_pipeline_runs(tiny_model, tmp_path):
    """Two processes at once, each running the real tiny pipeline 100 times and encoding the same frames after
    each run from buffers at other offsets and strides (64x64 each time, 832x480 every 10th): one digest per
    size, the same in both processes."""
    args = [str(tiny_model.parent), *save_frames(tmp_path, ((64, 64), (480, 832)))]
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: json.loads(python(REPEAT, {}, *args)), range(2))
    assert all(len(d) == 1 for d in first.values()), first
    assert first == second


def test_frames_sha256_depends_on_values_and_shape_only():
    """frames_sha256 is the same for a copy, a strided view and an offset buffer of the same values, and differs
    for the same bytes in another shape."""
    f = video_frames(4, 64, 64)
    wide = np.zeros((9, 64, 128, 3), np.uint8)
    wide[:, :, ::2] = f
    assert frames_sha256(f) == frames_sha256(f.copy()) == frames_sha256(wide[:, :, ::2])
    assert frames_sha256(f) != frames_sha256(f.reshape(9, 128, 32, 3))


def bench(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([REPLICADP, "bench", "--num-requests", "16", *SMALL, *args],
                          env={**os.environ, "REDIS_URL": url}, capture_output=True, text=True, timeout=600)


def protocol(url: str, name: str, tmp_path: Path, env: dict, *bench_args: str, model: str = "tiny") -> dict:
    """The isolation protocol on `url`: one replica records the baseline one request at a time, two other replica
    processes replay it at concurrency 4 (all of `model`, with `env`; `bench_args` for both benches). Asserts both
    benches succeeded, all 16 inputs matched and both replicas took part; returns the check's report."""
    baseline, report = tmp_path / "baseline.json", tmp_path / "two.json"
    one = start_replicas(1, url, f"{name}-1", model=model, **env)
    try:
        run = bench(url, *bench_args, "--concurrency", "1", "--warmup", "0", "--write-baseline", str(baseline))
    finally:
        one.stop()
    assert run.returncode == 0, run.stdout + run.stderr
    two = start_replicas(2, url, f"{name}-2", model=model, **env)
    try:
        run = bench(url, *bench_args, "--concurrency", "4", "--check-baseline", str(baseline), "--json", str(report))
    finally:
        two.stop()
    assert run.returncode == 0, run.stdout + run.stderr
    rep = json.loads(report.read_text())
    iso = rep["isolation"]
    assert (iso["matched"], iso["mismatched"], iso["passed"]) == (16, 0, True), iso["mismatches"]
    assert set(rep["per_replica"]) == set(two.names), rep["per_replica"]  # both replicas took part
    return rep


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_isolation_protocol_with_16_inputs(isa, redis_db, tiny_model, tmp_path):
    """The reference protocol with 16 distinct inputs: one replica serially records the baseline, two other
    replica processes at concurrency 4 replay it, and all 16 match bit for bit (frames and MP4). Run with the
    machine's own instruction set and with torch, MKL and oneDNN forced to AVX2 (what an AVX2-only machine
    runs), so that both kinds of machine are checked on either."""
    env = {"OUTPUT_DIR": str(tmp_path / "out"), **(AVX2 if isa == "avx2" else {})}
    protocol(redis_db(), f"isolation-{isa}", tmp_path, env)


def test_isolation_protocol_on_the_two_expert_stand_in(redis_db, tmp_path):
    """The reference protocol on tiny-a14b, Wan2.2-T2V-A14B's stand-in (its 8 steps run 6 on one expert, 2 on the
    other), standard and fast (TaylorSeer on each expert) in turn, with the idle expert kept in CPU memory
    (REPLICADP_OFFLOAD=expert: both experts move at every request): all 16 inputs match bit for bit between the
    baseline's replica and two others at concurrency 4, and each result says which path ran."""
    env = {"OUTPUT_DIR": str(tmp_path / "out"), "REPLICADP_CACHE": "taylorseer", "REPLICADP_OFFLOAD": "expert"}
    rep = protocol(redis_db(), "isolation-a14b", tmp_path, env, "--steps", "8", "--quality", "mixed",
                   model="tiny-a14b")
    assert rep["model"] == "tiny-a14b"
    stored = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]  # the output store's Results
    assert sorted(r["params"]["quality"] for r in stored) == ["fast"] * 18 + ["standard"] * 18


def test_replicas_run_mkl_in_reproducible_mode(redis_db, tiny_model, tmp_path):
    """A replica started with nothing set (MKL_CBWR empty: the test process itself has it set, conftest) runs
    MKL with conditional numerical reproducibility and says so: MKL's own log of each call reads CNR:AUTO,STRICT,
    never CNR:OFF."""
    url = redis_db()
    group = start_replicas(1, url, "mkl-verbose", OUTPUT_DIR=str(tmp_path), MKL_VERBOSE="1", MKL_CBWR="")
    try:
        run = bench(url, "--num-requests", "1", "--concurrency", "1", "--warmup", "0")
    finally:
        group.stop()
    assert run.returncode == 0, run.stdout + run.stderr
    log = group.log_path.read_text()
    assert "CNR:AUTO,STRICT" in log and "CNR:OFF" not in log


def outcome(index: int, seed: int, frames: np.ndarray, folder: Path, input_key: str | None = None) -> Outcome:
    """A successful Outcome whose video is `frames`, encoded into `folder`."""
    video = encode_mp4(frames, 24)
    path = folder / f"{input_key or seed}-{hashlib.sha256(video).hexdigest()[:8]}.mp4"
    path.write_bytes(video)
    result = {"input_key": input_key or f"key{seed}", "params": {"seed": seed}, "model": "tiny",
              "frames_sha256": frames_sha256(frames), "video_sha256": hashlib.sha256(video).hexdigest(),
              "replica": "replica0@test", "video_uri": path.as_uri()}
    return Outcome(index=index, request={"prompt": PROMPTS[index], "seed": seed}, task_id=str(index),
                   submitted_at=0.0, finished_at=1.0, ok=True, result=result)


def test_the_check_tells_numeric_noise_from_bleed(tmp_path):
    """Against a baseline of three inputs: an exact replay matches; an output one grey level off its own
    baseline is a mismatch read as numeric noise (over 10 dB closer to its own video than to any other), and
    with --tolerance-psnr below that PSNR it is tolerated and the check passes, saying so; an output that is
    another input's video is read as bleed and never tolerated."""
    videos = [video_frames(seed, 64, 64) for seed in (10, 11, 12)]
    baseline = tmp_path / "baseline.json"
    write_baseline(baseline, [outcome(i, 10 + i, v, tmp_path) for i, v in enumerate(videos)])
    assert len(list((tmp_path / "baseline.videos").glob("*.mp4"))) == 3

    exact = outcome(0, 10, videos[0], tmp_path)
    noisy = outcome(1, 11, np.clip(videos[1].astype(int) + 1, 0, 255).astype(np.uint8), tmp_path)
    bled = outcome(2, 12, videos[0], tmp_path, input_key="key12")  # input 12 answered with input 10's video

    strict = check_baseline(baseline, [exact, noisy, bled])
    assert (strict["matched"], strict["mismatched"], strict["passed"]) == (1, 2, False)
    noise, bleed = strict["mismatches"]
    assert noise["closer_to"] == "own" and noise["psnr_own_db"] > noise["psnr_other_db"] + 10, noise
    assert "numeric noise, not bleed" in describe_mismatch(noise)
    assert bleed["closer_to"] == "other" and bleed["closest_other"]["seed"] == 10
    assert bleed["psnr_other_db"] is None  # identical to input 10's video: infinite PSNR
    assert "CLOSER TO ANOTHER INPUT: bleed" in describe_mismatch(bleed)

    tolerant = check_baseline(baseline, [exact, noisy], tolerance_psnr=noise["psnr_own_db"] - 1)
    assert (tolerant["matched"], tolerant["tolerated"], tolerant["mismatched"], tolerant["passed"]) == (1, 1, 0, True)
    assert not check_baseline(baseline, [exact, noisy, bled], tolerance_psnr=0)["passed"]
    assert not check_baseline(baseline, [noisy], tolerance_psnr=noise["psnr_own_db"] + 1)["passed"]


def test_isolation_through_http_with_md5_of_the_body(redis_db, tiny_model, tmp_path):
    """vllm-omni's isolation check through `replicadp serve-http`: 16 inputs to /v1/videos/sync one at a time in
    front of one replica, then at concurrency 4 in front of two other replica processes: the md5 of every MP4
    body is the same as the first time."""
    from test_http import gateway

    forms = [{"prompt": PROMPTS[i % len(PROMPTS)], "seed": str(42 + i), "size": "64x64", "num_frames": "9",
              "num_inference_steps": "4"} for i in range(16)]

    def md5s(n: int, concurrency: int) -> tuple[list[str], set[str]]:
        url = redis_db()
        group = start_replicas(n, url, f"http-isolation-{n}", OUTPUT_DIR=str(tmp_path / str(n)))
        try:
            with gateway(url, f"isolation-{n}") as gw, ThreadPoolExecutor(concurrency) as pool:
                answers = list(pool.map(lambda form: gw.client.post("/v1/videos/sync", data=form), forms))
        finally:
            group.stop()
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        return [hashlib.md5(a.content).hexdigest() for a in answers], {a.headers["x-replica"] for a in answers}

    serial, _ = md5s(1, 1)
    concurrent, replicas = md5s(2, 4)
    assert len(set(serial)) == 16
    assert concurrent == serial
    assert len(replicas) == 2


def test_isolation_protocol_on_replicas_of_two_ranks(redis_db, tmp_path):
    """The reference protocol on replicas that each split every request over 2 processes (REPLICADP_PARALLEL=
    ulysses:2, gloo): one such replica serially records the baseline, two others at concurrency 4 replay it, and
    all 16 inputs match bit for bit; each Result says its layout. On the machine's own instruction set only: the
    one-process protocol above runs with AVX2 forced too, and a Ulysses split gives one process's frames bit for bit
    (test_layouts.py), so the split adds no path of its own to force."""
    env = {"OUTPUT_DIR": str(tmp_path / "out"), "REPLICADP_PARALLEL": "ulysses:2"}
    protocol(redis_db(), "isolation-k2", tmp_path, env)
    stored = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]
    assert stored and all(r["served"] == {"parallel": "ulysses:2"} for r in stored)
