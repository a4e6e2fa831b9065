"""Tenants behind API keys (client/http/auth.py): each key's policy from the keys file (its tenant's name, the highest
priority it may ask for), enforced by a real gateway process on a real Redis, and the tenant carried in the request
that the replicas receive (its fairness lane and webhook secret)."""

import base64
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import redis
from helpers import model_queue
from test_http import REPLICADP, SMALL, gateway, multipart

from client.http.auth import ApiKeyError, owner_of, read_keys
from replicadp_tasks.contract import Priority, queue_lists

ACME = ("key-acme-0123456789", "key-acme-rotated-0123")  # one tenant, two keys (a rotation)
OTHER = "key-other-9876543210"


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def queued_kwargs(url: str) -> list[dict]:
    """generate's kwargs of every request waiting in the queue, as a replica would receive them."""
    client = redis.Redis.from_url(url)
    return [json.loads(base64.b64decode(json.loads(raw)["body"]))[1]
            for key in queue_lists(model_queue()) for raw in client.lrange(key, 0, -1)]


@pytest.fixture(scope="module")
def tenants(redis_db, tmp_path_factory):
    """A gateway (no replica: jobs stay queued) with a keys file: acme's two keys, which may ask for interactive,
    and another key with the defaults (its own tenant, normal at most)."""
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    keys_file.write_text(f"# acme, rotating its key\n{ACME[0]} name=acme max_priority=interactive\n"
                         f"{ACME[1]}  max_priority=interactive name=acme\n{OTHER}\n")
    with gateway(redis_db(), "tenants", "--api-keys-file", str(keys_file)) as gw:
        yield gw


def create(gw, key: str, **fields) -> httpx.Response:
    return gw.client.post("/v1/videos", files=multipart({**SMALL, **fields}), headers=auth(key))


def test_a_key_may_not_ask_above_its_priority(tenants):
    """A key with the default policy asking for interactive gets 403 naming `priority` (OpenAI's error shape) and
    nothing is queued; normal and batch are served. acme's key, allowed interactive, gets it. (Had been: any key
    could send interactive and go ahead of every other key's work.)"""
    before = len(queued_kwargs(tenants.redis_url))
    refused = create(tenants, OTHER, priority="interactive")
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("priority_not_allowed", "priority"), error
    assert "'interactive'" in error["message"] and "normal at most" in error["message"], error
    assert len(queued_kwargs(tenants.redis_url)) == before
    for priority in ("normal", "batch"):
        assert create(tenants, OTHER, priority=priority).status_code == 200
    assert create(tenants, ACME[0], priority="interactive").status_code == 200
    assert len(queued_kwargs(tenants.redis_url)) == before + 3


def test_requests_carry_their_keys_tenant(tenants):
    """What a replica receives names the key's tenant: acme's name for either of its keys, the digest of the key
    (never the key) for a key without a name. A request's body cannot name a tenant (400 naming it)."""
    for n, key in enumerate((*ACME, OTHER)):
        assert create(tenants, key, prompt=f"made with key {n}").status_code == 200
    queued = queued_kwargs(tenants.redis_url)
    got = {kwargs["prompt"]: kwargs.get("tenant") for kwargs in queued}
    assert [got[f"made with key {n}"] for n in range(3)] == ["acme", "acme", owner_of(OTHER)]
    assert not any(key in json.dumps(queued) for key in (*ACME, OTHER))
    claimed = create(tenants, OTHER, tenant="acme")
    assert claimed.status_code == 400 and claimed.json()["error"]["param"] == "tenant", claimed.text


def test_a_tenants_keys_share_its_jobs(tenants):
    """A job made with one of acme's keys is listed and read with its other key (a rotated key keeps the tenant's
    jobs), and stays a 404 to another tenant's key."""
    job = create(tenants, ACME[0], prompt="made before the rotation").json()["id"]
    assert job in [j["id"] for j in tenants.client.get("/v1/videos?limit=100", headers=auth(ACME[1])).json()["data"]]
    assert tenants.client.get(f"/v1/videos/{job}", headers=auth(ACME[1])).status_code == 200
    assert tenants.client.get(f"/v1/videos/{job}", headers=auth(OTHER)).status_code == 404


@pytest.mark.parametrize("line, says", [
    ("key-0123456789 name=acme color=red", "found an attribute 'color'"),
    ("key-0123456789 max_priority=urgent", "max_priority='urgent': one of interactive, normal, batch"),
    ("key-0123456789 name=a/b", "name='a/b'"),
    ("key-0123456789 name=acme name=beta", "found an attribute 'name'"),
])
def test_a_bad_keys_file_stops_the_gateway_from_starting(redis_db, tmp_path, line, says):
    """A keys-file line with an unknown attribute, a priority that is none, a name outside the tenant alphabet or
    an attribute twice is refused at start (exit 2), naming the file, the line and what is wrong, never the key."""
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"good-key-0123456789\n{line}\n")
    run = subprocess.run([REPLICADP, "serve-http", "--api-keys-file", str(keys_file)], capture_output=True,
                         text=True, env={**os.environ, "REDIS_URL": redis_db()}, timeout=60)
    message = " ".join(run.stderr.split())  # click wraps long lines
    assert run.returncode == 2 and f"{keys_file}:2" in message and says in message, run.stderr
    assert "key-0123456789" not in run.stderr.replace("good-key-0123456789", "")


def test_a_keys_file_without_a_key_stops_the_gateway(redis_db):
    """The shipped api-keys.example, copied as it is (comments only), stops the gateway at start (exit 2) naming
    the file: a keys file is named to require keys, and one with none would leave the API open."""
    example = Path(__file__).resolve().parent.parent / "api-keys.example"
    run = subprocess.run([REPLICADP, "serve-http", "--api-keys-file", str(example)], capture_output=True,
                         text=True, env={**os.environ, "REDIS_URL": redis_db()}, timeout=60)
    message = " ".join(run.stderr.split())
    assert run.returncode == 2 and f"{example} holds no key" in message, run.stderr


def test_read_keys_gives_each_key_its_policy(tmp_path):
    """Keys on the command line have the defaults; a file's attributes come in any order; the same key given twice
    with one policy is one key, with two policies an error that names the tenants, not the key."""
    keys_file = tmp_path / "keys"
    keys_file.write_text("k-one max_priority=batch name=t1\nk-two\n")
    policies = read_keys(("k-cli", "k-two"), (keys_file,))
    assert [(p.owner, p.max_priority) for p in policies] == [
        (owner_of("k-cli"), Priority.NORMAL), (owner_of("k-two"), Priority.NORMAL), ("t1", Priority.BATCH)]
    assert [p.allows(Priority.NORMAL) for p in policies] == [True, True, False]
    assert "k-one" not in repr(policies)
    keys_file.write_text("k-two name=t2\n")
    with pytest.raises(ApiKeyError, match=f"different policies \\({owner_of('k-two')}, t2\\)"):
        read_keys(("k-two",), (keys_file,))
