"""A replica over K processes (REPLICADP_PARALLEL, parallel.py): the layout setting and what it refuses, then a
real K=2 replica of the tiny model on the CPU (its follower rank on gloo): a request through Python and HTTP that
says its layout, a size whose video tokens do not split, a cancel that both ranks leave at one step, and a
follower killed mid-request (the request completes once, on the rebuilt group). The K=2 isolation protocol is in
test_isolation.py."""

import json
import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from conftest import run_client_on, start_replicas
from helpers import tiny_request_lasting, wait_for, wait_for_reload, wait_for_step
from test_embedded import started_with
from test_http import REPLICADP, gateway, post

from client.api import _app_for
from replicadp_tasks import settings
from replicadp_tasks.contract import ModelLoadError
from replicadp_tasks.contract.keys import ATTEMPTS_KEY, REPLICA_KEY, STATS_KEY
from replicadp_tasks.model import CacheMethod, Layout, ModelOptions, Offload, PipelineHolder, StepCache
from replicadp_tasks.model.layout import check_heads

REQUEST = {"prompt": "two ranks, one fox", "seed": 4, "height": 64, "width": 64, "num_frames": 5,
           "num_inference_steps": 4}


def test_the_layout_setting_is_parsed_and_a_bad_one_named(monkeypatch):
    """REPLICADP_PARALLEL: `none` or empty is one process; KIND:DEGREE pairs multiply into the rank count and
    print back as given; a bad kind, degree or repeat stops the process with an error naming the variable."""
    assert Layout.parse("") == Layout.parse("none") == Layout() and Layout().size == 1 and str(Layout()) == "none"
    both = Layout.parse(" Ulysses:2, ring:2 ")
    assert (both.ulysses, both.ring, both.size, str(both)) == (2, 2, 4, "ulysses:2,ring:2")
    for bad, why in (("tensor:2", "expected KIND:DEGREE with KIND one of ulysses, ring, cfg"),
                     ("ulysses:0", "the degree must be a whole number of at least 1"),
                     ("ulysses:two", "the degree must be a whole number"), ("ulysses:2,ulysses:2", "given twice")):
        monkeypatch.setenv("REPLICADP_PARALLEL", bad)
        with pytest.raises(SystemExit, match=f"REPLICADP_PARALLEL={bad!r}: .*{why}"):
            settings.Settings.from_env()


def test_layouts_a_replica_cannot_run_are_refused_before_anything_starts(tiny_model):
    """At load, naming REPLICADP_PARALLEL, before a follower is started or a weight loaded: a cfg degree other than
    1 or 2, ring on an attention backend that does not return the log-sum-exp, the options that have not run on a
    split transformer (offload, compile), the step caches that decide from each rank's own slice (FirstBlockCache)
    and any step cache under cfg (each keeps its state per pass). A Ulysses degree must divide the attention
    heads."""
    cases = [({"layout": Layout(cfg=3)}, r"REPLICADP_PARALLEL=cfg:3: a step has two passes \(conditional, "
                                         r"unconditional\), so cfg is 1 or 2"),
             ({"layout": Layout(ring=2), "attention": "_native_math"},
              r"REPLICADP_PARALLEL=ring:2 with REPLICADP_ATTENTION='_native_math': ring attention needs a backend "
              r"that returns the log-sum-exp; on cpu: native"),
             ({"layout": Layout(ulysses=2), "offload": Offload.MODEL},
              r"REPLICADP_PARALLEL=ulysses:2 cannot be combined with REPLICADP_OFFLOAD=model"),
             ({"layout": Layout(ulysses=2), "compile": "blocks"}, r"cannot be combined with REPLICADP_COMPILE=blocks"),
             ({"layout": Layout(ulysses=2), "cache": StepCache.of(CacheMethod.FIRST_BLOCK)},
              r"cannot be combined with REPLICADP_CACHE=first-block"),
             ({"layout": Layout(cfg=2), "cache": StepCache.of(CacheMethod.TAYLORSEER)},
              r"REPLICADP_PARALLEL=cfg:2 cannot be combined with REPLICADP_CACHE=taylorseer")]
    for options, error in cases:
        h = PipelineHolder(ModelOptions("tiny", model_cache=tiny_model.parent, **options))
        with pytest.raises(ModelLoadError, match=error):
            h.load()
        assert h.followers is None and h.pipe is None
    check_heads(Layout(ulysses=2), 2)
    with pytest.raises(ModelLoadError, match=r"REPLICADP_PARALLEL=ulysses:4: the model's 2 attention heads do not "
                                             r"split over 4 ranks"):
        check_heads(Layout(ulysses=4), 2)


@pytest.mark.cluster
def test_up_with_more_ranks_than_heads_names_the_layout(clean_env):
    """`REPLICADP_PARALLEL=ulysses:4 replicadp up`, on the tiny model of 2 attention heads: the replica's ranks
    form their group and load, then refuse the layout by name; `up` exits 1 with that error, nothing left."""
    env, tmp = clean_env
    env.update(REPLICADP_PARALLEL="ulysses:4", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([REPLICADP, "up", "--threads", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "REPLICADP_PARALLEL=ulysses:4: the model's 2 attention heads do not split over 4 ranks" in run.stderr
    assert wait_for(lambda: started_with(tmp) == set(), "every process of the run to end", timeout=30)


@pytest.fixture(scope="module")
def k2(redis_db, tiny_model, tmp_path_factory):
    """One replica of the tiny model over 2 ranks (REPLICADP_PARALLEL=ulysses:2) on a database of its own."""
    url, out = redis_db(), tmp_path_factory.mktemp("k2-out")
    group = start_replicas(1, url, "ulysses2", REPLICADP_PARALLEL="ulysses:2", OUTPUT_DIR=str(out))
    try:
        yield SimpleNamespace(url=url, group=group, app=_app_for(url), out=out, names=group.names)
    finally:
        group.stop()


def followers_of(pid: int) -> list[int]:
    """The follower ranks a pool child started (their command line names the module)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat, cmdline = (proc / "stat").read_text(), (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"replicadp_tasks.model.follower" in cmdline:
            found.append(int(proc.name))
    return found


@pytest.mark.cluster
def test_a_k2_replica_serves_through_python_and_http_and_says_its_layout(k2):
    """The K=2 replica serves a request from generate.delay() and the same input through the HTTP form: the same
    frames, the Result's `served` says `parallel: ulysses:2` (part of the input's identity), and the replica's
    published info and `replicadp status --json` say the layout; its pool child has one follower rank. A size
    whose video tokens (32x96, 1 frame: 3) do not split over 2 ranks is refused naming the fields."""
    python, odd = run_client_on(k2.url, [REQUEST, {**REQUEST, "height": 32, "width": 96, "num_frames": 1}],
                                concurrency=1, timeout=120)
    assert python.ok, python.error
    assert python.result["served"] == {"parallel": "ulysses:2"}
    assert not odd.ok and odd.error.startswith("InvalidRequest: height x width x num_frames='32x96x1': its 3 video "
                                               "tokens do not split over the replica's 2 sequence ranks"), odd.error
    form = {"prompt": REQUEST["prompt"], "seed": "4", "size": "64x64", "num_frames": "5", "num_inference_steps": "4"}
    with gateway(k2.url, "ulysses2") as gw:
        answer = post(gw, "/v1/videos/sync", form)
    assert answer.status_code == 200, answer.text
    info = json.loads(redis.Redis.from_url(k2.url).get(REPLICA_KEY + k2.names[0]))
    assert info["parallel"] == "ulysses:2" and len(followers_of(info["pid"])) == 1
    run = subprocess.run([REPLICADP, "status", "--json"], env={**os.environ, "REDIS_URL": k2.url},
                         capture_output=True, text=True, timeout=60)
    assert [r["parallel"] for r in json.loads(run.stdout)["replicas"]] == ["ulysses:2"], run.stdout + run.stderr
    stored = json.loads((k2.out / f"{python.result['request_id']}.json").read_text())
    assert stored["frames_sha256"] == python.result["frames_sha256"]


@pytest.mark.cluster
def test_a_cancel_ends_the_request_on_both_ranks_and_the_group_serves_on(k2):
    """A request cancelled mid-denoising (`replicadp cancel`) stops on both ranks at one step boundary (they agree
    on it): the request ends cancelled, and the same pool child and follower serve the next request."""
    request = {"prompt": "to be cancelled", **tiny_request_lasting(30, lambda r: run_client_on(
        k2.url, [r], concurrency=1, timeout=120)[0].result)}
    result = k2.app.send_task("replicadp.generate", kwargs=request)
    info = wait_for_step(k2, result.id, 1)
    before = followers_of(info["pid"])
    run = subprocess.run([REPLICADP, "cancel", result.id], env={**os.environ, "REDIS_URL": k2.url},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    with pytest.raises(Exception, match="cancelled at step"):
        result.get(timeout=120)
    after = run_client_on(k2.url, [REQUEST], concurrency=1, timeout=120)[0]
    assert after.ok, after.error
    assert after.result["execution"].split(":")[1] == str(info["pid"])
    assert followers_of(info["pid"]) == before and len(before) == 1


@pytest.mark.cluster
def test_a_follower_killed_mid_request_ends_the_attempt_and_the_request_completes_once(k2):
    """The follower rank SIGKILLed while a request denoises: rank 0 leaves the broken collective and its pool
    child exits; the request is requeued, the pool's next child starts a new follower, and the request completes
    once (two starts, one Result, no duplicate execution) with the frames of the same input run without a kill."""
    request = {"prompt": "through a follower kill", "seed": 9, **tiny_request_lasting(4, lambda r: run_client_on(
        k2.url, [r], concurrency=1, timeout=120)[0].result)}
    result = k2.app.send_task("replicadp.generate", kwargs=request)
    info = wait_for_step(k2, result.id, 1)
    (follower,) = followers_of(info["pid"])
    os.kill(follower, signal.SIGKILL)
    killed = result.get(timeout=180)
    client = redis.Redis.from_url(k2.url)
    assert killed["redelivered"] and int(client.get(ATTEMPTS_KEY + result.id)) == 2
    assert int(client.hget(STATS_KEY, "duplicate_executions") or 0) == 0
    new_pid = json.loads(client.get(REPLICA_KEY + k2.names[0]))["pid"]
    assert new_pid != info["pid"] and len(followers_of(new_pid)) == 1
    plain = run_client_on(k2.url, [{**request, "request_id": "without-a-kill"}], concurrency=1, timeout=120)[0]
    assert plain.ok and plain.result["frames_sha256"] == killed["frames_sha256"]


@pytest.mark.cluster
def test_a_follower_hung_mid_request_ends_the_attempt_past_the_timeout(redis_db, tiny_model, tmp_path):
    """The follower rank SIGSTOPped while a request denoises (alive, but never answering): rank 0 waits in its
    collective for REPLICADP_PARALLEL_TIMEOUT (3 s here), then its pool child exits; the stopped follower dies
    with it (PDEATHSIG), the request is requeued and completes once on the rebuilt group."""
    url = redis_db()
    group = start_replicas(1, url, "ulysses2-hang", REPLICADP_PARALLEL="ulysses:2", REPLICADP_PARALLEL_TIMEOUT="3",
                           OUTPUT_DIR=str(tmp_path))
    app = SimpleNamespace(app=_app_for(url))
    try:
        request = {"prompt": "through a hang", **tiny_request_lasting(4, lambda r: run_client_on(
            url, [r], concurrency=1, timeout=120)[0].result)}
        result = app.app.send_task("replicadp.generate", kwargs=request)
        info = wait_for_step(app, result.id, 1)
        (follower,) = followers_of(info["pid"])
        os.kill(follower, signal.SIGSTOP)
        done = result.get(timeout=180)
        gone = wait_for(lambda: not Path(f"/proc/{follower}").exists(), "the stopped follower to die", timeout=30)
        attempts = int(redis.Redis.from_url(url).get(ATTEMPTS_KEY + result.id))
    finally:
        group.stop()
    assert done["redelivered"] and attempts == 2 and gone
    log = group.log_path.read_text()
    assert f"request {result.id}: rank 0: RuntimeError: " in log and "Timed out waiting 3000ms" in log
    assert "exited with 'exitcode 76'" in log  # outcomes.Exit.GROUP_LOST


@pytest.mark.cluster
def test_a_follower_killed_while_idle_rebuilds_the_group(k2):
    """A follower SIGKILLed between requests: rank 0's watcher ends its pool child at once (no request waits on a
    broken group), the pool's next child loads with a new follower, and the next request is served."""
    client = redis.Redis.from_url(k2.url)
    old = json.loads(client.get(REPLICA_KEY + k2.names[0]))["pid"]
    (follower,) = followers_of(old)
    os.kill(follower, signal.SIGKILL)
    wait_for_reload(client, k2.names[0], old)
    new = json.loads(client.get(REPLICA_KEY + k2.names[0]))["pid"]
    assert len(followers_of(new)) == 1
    served = run_client_on(k2.url, [REQUEST], concurrency=1, timeout=120)[0]
    assert served.ok and served.result["execution"].split(":")[1] == str(new), served.error


@pytest.mark.cluster
def test_a_k2_run_is_checked_against_a_one_process_baseline(k2, replicas, redis_server, tmp_path):
    """A baseline recorded on the session's one-process replicas (it records each input's `served`), checked with
    `--tolerance-psnr` against a run on the K=2 replica: every input is found across the layouts (none unknown,
    although the K=2 results' input keys differ from the baseline's) and passes, bit for bit or by PSNR."""
    baseline, report = tmp_path / "k1.json", tmp_path / "k2.json"
    bench = [REPLICADP, "bench", "--num-requests", "4", "--size", "64x64", "--num-frames", "5", "--steps", "4",
             "--concurrency", "1", "--warmup", "0"]
    one = subprocess.run([*bench, "--write-baseline", str(baseline)], env={**os.environ, "REDIS_URL": redis_server.url},
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout + one.stderr
    entries = json.loads(baseline.read_text())["entries"]
    assert len(entries) == 4 and all(e["served"] == {} for e in entries.values())
    two = subprocess.run([*bench, "--check-baseline", str(baseline), "--tolerance-psnr", "40", "--json", str(report)],
                         env={**os.environ, "REDIS_URL": k2.url}, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout + two.stderr
    iso = json.loads(report.read_text())["isolation"]
    assert iso["unknown"] == 0 and iso["matched"] + iso["tolerated"] == 4 and iso["passed"], iso


def test_a_new_group_removes_the_rendezvous_files_of_rank_0s_that_are_gone(tmp_path, monkeypatch):
    """A replica's ranks meet through a file (no port); a rank 0 killed before it could remove its file leaves it:
    the next group's new_store removes the files of dead rank 0s, keeps those of live ones, and names its own by
    its pid."""
    import tempfile

    from replicadp_tasks.model.parallel import STORE_PREFIX, new_store

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone, live = tmp_path / f"{STORE_PREFIX}{dead.pid}-abc", tmp_path / f"{STORE_PREFIX}{os.getpid()}-def"
    gone.write_text("x")
    live.write_text("x")
    path = new_store()
    assert not gone.exists() and live.exists()
    assert Path(path).parent == tmp_path and Path(path).name.startswith(f"{STORE_PREFIX}{os.getpid()}-")
