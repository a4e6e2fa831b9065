"""The Kubernetes manifests (deploy/kubernetes): every overlay rendered by kubectl's kustomize, validated against
the Kubernetes API schemas (kubernetes-validate, offline) and KEDA's and the Prometheus operator's fields, and
checked for what a deployment rests on. What must match the code is computed from it: each pod's settings are
parsed by `Settings.from_env` from the environment its ConfigMaps and Secrets give it, and each ScaledObject's query
is evaluated on what the real exporter (`Exporter.collect`) exports for queues whose lists are named by
`queue_for` and `queue_lists`. No cluster is started (none can be here): docs/kubernetes.md says what that leaves.
"""

import base64
import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import client.ops.metrics as metrics
import client.ops.status as status
from client.cli import main as cli
from client.http.guard import allowed_hosts, host_name
from client.ops.flower import credentials
from client.ops.metrics import Exporter
from replicadp_tasks.cluster import connection
from replicadp_tasks.cluster.heartbeat import Heartbeat
from replicadp_tasks.contract import Priority, queue_for
from replicadp_tasks.contract.keys import REPLICA_KEY
from replicadp_tasks.contract.scheduling import queue_lists
from replicadp_tasks.settings import Settings

KUBE = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir() if p.is_dir())
# The oldest Kubernetes docs/kubernetes.md supports (a probe's own terminationGracePeriodSeconds is GA in 1.28),
# and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
# After a request's time limit, a replica encodes and stores its last video before its warm shutdown ends.
FINISH_MARGIN_S = 60
# A Deployment's pod is <name>-<pod-template-hash, up to 10>-<5>, and its hostname that name cut to 63.
POD_NAME = "{}-7c9d5b8f4d-x2kzq"
HOSTNAME_MAX = 63

# KEDA 2.16's ScaledObject (keda.sh/v1alpha1), the fields these manifests use; HPA behavior is checked by the
# Kubernetes schema of the HorizontalPodAutoscaler KEDA makes. A trigger's metadata is a map of strings.
INT = {"type": "integer", "minimum": 0}
SCALED_OBJECT = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"name": {"type": "string"}, "kind": {"type": "string"},
                                                  "apiVersion": {"type": "string"}}},
                "minReplicaCount": INT, "maxReplicaCount": INT, "pollingInterval": INT, "cooldownPeriod": INT,
                "fallback": {"type": "object", "required": ["failureThreshold", "replicas"],
                             "additionalProperties": False,
                             "properties": {"failureThreshold": INT, "replicas": INT}},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False,
                                                      "properties": {"name": {"type": "string"},
                                                                     "behavior": {"type": "object"}}}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {"type": {"type": "string"}, "name": {"type": "string"},
                                   "metricType": {"enum": ["AverageValue", "Value"]},
                                   "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}}},
            }},
    }}
# The prometheus scaler's metadata keys (KEDA 2.16).
PROMETHEUS_KEYS = {"serverAddress", "query", "threshold", "activationThreshold", "ignoreNullValues", "namespace",
                   "customHeaders", "queryParameters", "unsafeSsl", "timeout"}
# The Prometheus operator's ServiceMonitor (monitoring.coreos.com/v1), the fields used here.
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
                 "properties": {
                     "selector": {"type": "object", "additionalProperties": False,
                                  "properties": {"matchLabels": {"type": "object"}}},
                     "endpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False,
                         "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                        "interval": {"type": "string", "pattern": r"^\d+[smh]$"}}}}}},
    }}
CUSTOM = {"ScaledObject": SCALED_OBJECT, "ServiceMonitor": SERVICE_MONITOR}


class Render:
    """One overlay as kubectl renders it, with the lookups the checks share."""

    def __init__(self, name: str, docs: list[dict]):
        self.name, self.docs = name, docs

    def of(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.of(kind) if d["metadata"]["name"] == name]
        assert found, f"{self.name}: no {kind} {name!r} in the render"
        return found[0]

    def data(self, kind: str, name: str) -> dict[str, str]:
        doc = self.get(kind, name)
        if kind == "Secret":
            return {k: base64.b64decode(v).decode() for k, v in doc.get("data", {}).items()} | doc.get("stringData", {})
        return doc.get("data", {})

    def workloads(self) -> list[dict]:
        return self.of("Deployment") + self.of("StatefulSet")

    def containers(self):
        """(workload, pod spec, container) of every container."""
        for w in self.workloads():
            spec = w["spec"]["template"]["spec"]
            for c in spec["containers"]:
                yield w, spec, c

    def env(self, container: dict) -> dict[str, str]:
        """The environment the container starts with, from its ConfigMaps, Secrets and values."""
        env = {}
        for source in container.get("envFrom", []):
            for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if ref in source:
                    env |= self.data(kind, source[ref]["name"])
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
                continue
            for kind, ref in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                if ref in var["valueFrom"]:
                    key = var["valueFrom"][ref]
                    env[var["name"]] = self.data(kind, key["name"])[key["key"]]
        return env

    def replicadp(self):
        """(workload, pod spec, container, Settings) of every container that runs the replicadp image."""
        for w, spec, c in self.containers():
            if c["image"].rpartition("/")[2].split(":")[0] == "replicadp":
                yield w, spec, c, Settings.from_env(self.env(c))

    def by_command(self, *start: str):
        found = [(w, s, c, st) for w, s, c, st in self.replicadp() if c["command"][:len(start)] == list(start)]
        assert found, f"{self.name}: no container runs {' '.join(start)}"
        return found

    def workers(self):
        return self.by_command("celery", "-A", "replicadp_tasks", "worker")


def selects(selector: dict, labels: dict) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions In/Exists) selects `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] in ("In", "Exists"), e
        if e["key"] not in labels or (e["operator"] == "In" and labels[e["key"]] not in e["values"]):
            return False
    return True


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def kubectl() -> str:
    found = shutil.which("kubectl")
    assert found, "kubectl is missing: `make install-test` installs Debian's kubernetes-client"
    return found


def render(tree: Path, overlay: str) -> subprocess.CompletedProcess:
    return subprocess.run([kubectl(), "kustomize", str(tree / "overlays" / overlay)], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """deploy/kubernetes with each overlay's secret files written from their examples, as a user starts."""
    tree = tmp_path_factory.mktemp("kubernetes") / "kubernetes"
    shutil.copytree(KUBE, tree)
    for example in tree.glob("overlays/*/*.example"):
        shutil.copy(example, example.with_suffix(""))
    return tree


@pytest.fixture(scope="module")
def renders(tree) -> dict[str, Render]:
    out = {}
    for overlay in OVERLAYS:
        done = render(tree, overlay)
        assert done.returncode == 0, f"{overlay}: {done.stderr}"
        out[overlay] = Render(overlay, [d for d in yaml.safe_load_all(done.stdout) if d])
    return out


@pytest.fixture(params=OVERLAYS)
def r(request, renders) -> Render:
    """Each overlay's render in turn."""
    return renders[request.param]


def validate(doc: dict) -> None:
    """Against the Kubernetes API's schemas (strict: an unknown field is an error), or our CRD schemas."""
    if doc["kind"] in CUSTOM:
        jsonschema.validate(doc, CUSTOM[doc["kind"]])
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


# --- rendering and schemas ------------------------------------------------------------------------------------


def test_every_overlay_renders_and_validates_against_the_api_schemas(r):
    """Each overlay renders, and every object in it is valid for the oldest and newest Kubernetes supported (or
    KEDA's and the Prometheus operator's fields); KEDA's HPA behavior is valid as the HPA it becomes."""
    assert len(r.docs) > 10
    for doc in r.docs:
        validate(doc)
    for so in r.of("ScaledObject"):
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        validate({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "keda"},
                  "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "w"},
                           "maxReplicas": so["spec"]["maxReplicaCount"], "behavior": behavior}})


def test_the_validators_refuse_a_misspelt_field(renders):
    """The schema checks have teeth: a misspelt field in a Deployment and in a ScaledObject is refused."""
    r = renders[OVERLAYS[0]]
    worker = copy.deepcopy(r.workers()[0][0])
    worker["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 60
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(worker)
    so = copy.deepcopy(r.of("ScaledObject")[0])
    so["spec"]["cooldownPeriods"] = 60
    with pytest.raises(jsonschema.ValidationError):
        validate(so)
    so = copy.deepcopy(r.of("ScaledObject")[0])
    so["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # KEDA's CRD takes strings only
    with pytest.raises(jsonschema.ValidationError):
        validate(so)


def test_an_overlay_whose_secrets_are_not_written_does_not_render(tree, tmp_path):
    """A user who has not written an overlay's secret files gets an error naming the file, not a deployment with
    an example's placeholder password."""
    for overlay in OVERLAYS:
        bare = tmp_path / overlay
        shutil.copytree(tree, bare)
        (bare / "overlays" / overlay / "redis.env").unlink()
        done = render(bare, overlay)
        assert done.returncode != 0 and "redis.env" in done.stderr, done.stderr


# --- workers: GPUs, grace, probes -----------------------------------------------------------------------------


def test_each_worker_pod_asks_for_the_gpus_of_its_models_layout(r):
    """Every worker pod requests and limits nvidia.com/gpu to K, the GPUs its REPLICADP_PARALLEL layout runs on
    (one per rank, which a replica checks at load), tolerates the GPU nodes' taint, and the fleet has a K=1 and a
    K=2 model."""
    ks = {}
    for w, spec, c, settings in r.workers():
        resources = c["resources"]
        gpus = int(resources["limits"]["nvidia.com/gpu"])
        assert int(resources["requests"]["nvidia.com/gpu"]) == gpus >= 1
        if settings.parallel.size > 1:
            assert gpus == settings.parallel.size, (w["metadata"]["name"], gpus, str(settings.parallel))
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        ks[settings.served_model_name] = gpus
    assert sorted(ks.values()) == [1, 2], ks
    assert len(ks) == len(r.workers()), "two worker Deployments serve one model name"


def test_a_worker_outlives_its_longest_request_when_stopped(r):
    """A worker's grace period covers a request started just before SIGTERM (Celery's warm shutdown waits for it):
    the hard time limit the pod's own settings give, plus the encode and store after it; a worker has no preStop
    to eat into it; only the liveness probe's kill, of a replica with nothing to finish, is short."""
    for w, spec, c, settings in r.workers():
        assert spec["terminationGracePeriodSeconds"] >= settings.time_limit_s + FINISH_MARGIN_S
        assert "lifecycle" not in c
        assert c["livenessProbe"]["terminationGracePeriodSeconds"] < spec["terminationGracePeriodSeconds"]


def test_the_gateway_stops_within_its_grace_period(r):
    """The gateway's grace covers its preStop pause and its own graceful stop (--shutdown-grace, from the CLI's
    default or the pod's environment), after which its sync requests are answered with their job id."""
    (w, spec, c, _), *_ = r.by_command("replicadp", "serve-http")
    option = next(p for p in cli.commands["serve-http"].params if p.name == "shutdown_grace")
    grace = float(r.env(c).get(option.envvar, option.default))
    pause = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert spec["terminationGracePeriodSeconds"] >= pause + grace + 10


def test_worker_probes_check_the_replica_the_pod_runs(r):
    """Startup, readiness and liveness run `replicadp health --replica N` with N the name the worker's command
    gives its replica (another name would never pass), and the startup probe waits longer than a model's load."""
    health = cli.commands["health"]
    known = {o for p in health.params for o in p.opts}
    for w, spec, c, settings in r.workers():
        name = c["command"][c["command"].index("-n") + 1]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = c[probe]["exec"]["command"]
            assert command[:2] == ["replicadp", "health"] and command[command.index("--replica") + 1] == name
            assert {a for a in command if a.startswith("--")} <= known
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] > settings.load_timeout_s


def test_replicadp_command_lines_use_options_the_cli_has(r):
    """Every `replicadp` command in a pod (servers and probes) names a command and options the CLI defines."""
    for w, spec, c in r.containers():
        lines = [c.get("command", [])] + [c[p]["exec"]["command"] for p in ("startupProbe", "readinessProbe",
                                                                           "livenessProbe") if "exec" in c.get(p, {})]
        for line in (line for line in lines if line[:1] == ["replicadp"]):
            command = cli.commands[line[1]]
            known = {o for p in command.params for o in p.opts}
            assert {a for a in line[2:] if a.startswith("--")} <= known, line


def test_replica_names_are_the_pods_names(r):
    """A worker pod's hostname is its whole name (Kubernetes cuts it at 63), so each replica's name is distinct
    and predictable: the scaling queries pick a model's replicas by it."""
    for w, spec, c, _ in r.workers():
        assert len(POD_NAME.format(w["metadata"]["name"])) <= HOSTNAME_MAX
        assert "hostname" not in spec and "subdomain" not in spec


# --- scaling -------------------------------------------------------------------------------------------------


def exported(url: str, settings: Settings, lists: dict[str, list], running: dict[str, str | None],
             monkeypatch) -> list:
    """The samples Prometheus scrapes from `replicadp metrics` run with `settings` on the empty Redis database
    `url` once it holds `lists` (raw messages) and live replicas `running` (name -> the model whose request it
    runs, or None: idle), each beating as a replica does and with its info; as two exporters' (an old pod still
    scraped: each series twice, by `instance`)."""
    client = redis.Redis.from_url(url)
    for key, items in lists.items():
        client.rpush(key, *items)
    for name, model in running.items():
        client.set(REPLICA_KEY + name, json.dumps({"model": model or "idle-model"}))
        beat = Heartbeat(name, url, settings.replica_stale_s, lambda: True, lambda: None, [], settings.queue)
        beat.beat(True, {"task_id": f"task-{name}", "started_at": 0.0, "priority": "normal"} if model else None)
    monkeypatch.setattr(status, "SETTINGS", settings)
    monkeypatch.setattr(metrics, "SETTINGS", settings)
    registry = CollectorRegistry()
    exporter = Exporter(registry)  # its busy gauge counts Celery's events, which it is not sent here
    exporter.redis = connection.client(url)
    families = text_string_to_metric_families(generate_latest(registry).decode())
    samples = [s for family in families for s in family.samples]
    return [s._replace(labels=s.labels | {"instance": i}) for i in ("a", "b") for s in samples]


TOKEN = re.compile(r'\s*(=~|[(){},+=]|"(?:[^"\\]|\\.)*"|[A-Za-z_:][A-Za-z0-9_:]*|\d+(?:\.\d+)?)')


def promql(query: str, samples: list) -> float | None:
    """`query` evaluated on `samples`, for the PromQL the ScaledObjects use: selectors with = and =~, sum and max
    (with `by`), `+` of single values and `or vector(N)`; None for an empty result (KEDA's null)."""
    tokens, at = [], 0
    while at < len(query.rstrip()):
        match = TOKEN.match(query, at)
        assert match, f"promql: cannot read {query[at:]!r}"
        tokens.append(match.group(1))
        at = match.end()
    tokens.append("")

    def take(expected=None):
        token = tokens.pop(0)
        assert expected is None or token == expected, f"promql: expected {expected!r}, got {token!r} in {query!r}"
        return token

    def expression():
        left = term()
        while tokens[0] == "+":
            take("+")
            right = term()
            left = {(): left[()] + right[()]} if () in left and () in right else {}
        return left

    def term():
        if tokens[0] == "(":
            take("(")
            inner = expression()
            if tokens[0] == "or":
                take("or"), take("vector"), take("(")
                fallback = float(take())
                take(")")
                inner = inner or {(): fallback}
            take(")")
            return inner
        if tokens[0] in ("sum", "max"):
            op, by = take(), ()
            if tokens[0] == "by":
                take("by"), take("(")
                while tokens[0] != ")":
                    label = take()
                    by += (label,) if label != "," else ()
                take(")")
            take("(")
            inner = term()
            take(")")
            groups = {}
            for labels, value in inner.items():
                key = tuple((k, v) for k, v in labels if k in by)
                groups.setdefault(key, []).append(value)
            return {k: (sum if op == "sum" else max)(v) for k, v in groups.items()}
        return selector()

    def selector():
        name, matchers = take(), []
        take("{")
        while tokens[0] != "}":
            label, op, value = take(), take(), json.loads(take())
            matchers.append((label, op, value))
            if tokens[0] == ",":
                take(",")
        take("}")
        return {tuple(sorted(s.labels.items())): s.value for s in samples if s.name == name and all(
            (s.labels.get(k) == v) if op == "=" else bool(re.fullmatch(v, s.labels.get(k, "")))
            for k, op, v in matchers)}

    result = expression()
    assert tokens == [""], f"promql: {tokens} left over in {query!r}"
    assert len(result) <= 1, f"promql: {query!r} gives several series"
    return next(iter(result.values()), None)


def scalers(r: Render):
    """(ScaledObject, its Deployment, that worker's Settings) of each model."""
    workers = {w["metadata"]["name"]: (w, settings) for w, _, _, settings in r.workers()}
    assert len(r.of("ScaledObject")) == len(workers)
    for so in r.of("ScaledObject"):
        w, settings = workers[so["spec"]["scaleTargetRef"]["name"]]
        yield so, w, settings


def test_each_scaler_counts_its_models_waiting_and_running_requests(r, redis_db, monkeypatch):
    """Each ScaledObject's query, on what the exporter exports, is the requests its model has in the system:
    waiting at every priority (the lists named by the code, as kombu writes them) plus those its replicas run (their
    heartbeats); not another model's, nor an idle replica's, nor twice for a scraped duplicate."""
    (_, _, _, exporter_settings), *_ = r.by_command("replicadp", "metrics")
    lists, running, expected = {}, {}, {}
    for i, (so, w, settings) in enumerate(scalers(r)):
        model = settings.served_model_name
        waiting = {priority: i + level for level, priority in enumerate(Priority, start=1)}
        for priority, key in zip(Priority, queue_lists(queue_for(settings.queue, model))):
            lists[key] = [b'{"headers": {}}'] * waiting[priority]
        for n in range(i + 2):  # i + 1 running, one idle
            running[f"replica0@{w['metadata']['name']}-{n}"] = model if n <= i else None
        expected[so["metadata"]["name"]] = sum(waiting.values()) + i + 1
    samples = exported(redis_db(), exporter_settings, lists, running, monkeypatch)
    got = {so["metadata"]["name"]: promql(so["spec"]["triggers"][0]["metadata"]["query"], samples)
           for so, _, _ in scalers(r)}
    assert got == expected


def test_a_declared_model_with_no_replica_scales_from_zero(r, redis_db, monkeypatch):
    """A model with no replica, never declared in Redis: its query is 0 (not empty) with nothing waiting, and one
    waiting request activates it, because the exporter exports every model in its REPLICADP_MODELS; a model at
    minReplicaCount 0 is declared to the gateway too (which queues its requests instead of refusing them). Without
    the declaration the query is empty, which KEDA is told to take as an error (its fallback), not as 0."""
    (_, _, _, exporter_settings), *_ = r.by_command("replicadp", "metrics")
    (_, _, _, gateway_settings), *_ = r.by_command("replicadp", "serve-http")
    for so, w, settings in scalers(r):
        model, trigger = settings.served_model_name, so["spec"]["triggers"][0]
        query, meta = trigger["metadata"]["query"], trigger["metadata"]
        assert model in exporter_settings.models
        if so["spec"]["minReplicaCount"] == 0:
            assert model in gateway_settings.models
        assert promql(query, exported(redis_db(), exporter_settings, {}, {}, monkeypatch)) == 0
        one = {queue_lists(queue_for(settings.queue, model))[1]: [b'{"headers": {}}']}
        assert promql(query, exported(redis_db(), exporter_settings, one, {}, monkeypatch)) > float(
            meta["activationThreshold"])
        undeclared = Settings.from_env({"REDIS_URL": "redis://127.0.0.1:6379/0"})
        assert promql(query, exported(redis_db(), undeclared, one, {}, monkeypatch)) is None
        assert meta["ignoreNullValues"] == "false" and so["spec"]["fallback"]["replicas"] >= 1


def test_scalers_use_the_prometheus_scaler_one_per_model(r):
    """Each model has one ScaledObject, with one prometheus trigger whose keys KEDA knows, scaling a Deployment of
    the render that serves a distinct model; scale-down waits longer than scale-up."""
    served = []
    for so, w, settings in scalers(r):
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and set(trigger["metadata"]) <= PROMETHEUS_KEYS
        assert so["spec"]["maxReplicaCount"] >= max(1, so["spec"]["minReplicaCount"])
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] > behavior["scaleUp"]["stabilizationWindowSeconds"]
        assert "replicas" not in w["spec"], "a Deployment that names its replicas fights its autoscaler"
        served.append(settings.served_model_name)
    assert len(served) == len(set(served)) == 2


# --- secrets, settings, security ------------------------------------------------------------------------------


def test_every_secret_config_map_and_claim_referenced_exists(r):
    """Every Secret, ConfigMap (and key) and PersistentVolumeClaim a pod names is in the render (a StatefulSet's
    claims come from its templates), the gateway's --api-keys-file is a key of the Secret mounted there, and an
    Ingress's TLS Secret is in the render or made by cert-manager."""
    for w, spec, c in r.containers():
        r.env(c)  # each envFrom and valueFrom, key included, or KeyError / an assertion
    for w in r.workloads():
        spec = w["spec"]["template"]["spec"]
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                r.get("Secret", volume["secret"]["secretName"])
            if "configMap" in volume:
                r.get("ConfigMap", volume["configMap"]["name"])
            if "persistentVolumeClaim" in volume:
                r.get("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        for mount in (m for c in spec["containers"] for m in c.get("volumeMounts", [])):
            assert mount["name"] in {v["name"] for v in spec.get("volumes", [])} | templates
    (_, spec, gateway, _), *_ = r.by_command("replicadp", "serve-http")
    keys = Path(gateway["command"][gateway["command"].index("--api-keys-file") + 1])
    mount = next(m for m in gateway["volumeMounts"] if keys.parent == Path(m["mountPath"]))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert keys.name in r.data("Secret", volume["secret"]["secretName"]), "the gateway's keys file is not mounted"
    for ingress in r.of("Ingress"):
        for tls in ingress["spec"].get("tls", []):
            made = "cert-manager.io/cluster-issuer" in ingress["metadata"].get("annotations", {})
            assert made or r.get("Secret", tls["secretName"])


def test_every_replicadp_pod_parses_its_settings_and_shares_one_redis_and_queue(r):
    """Each replicadp container's settings parse (a bad value would stop the pod at start), and all of them name
    the same Redis and the same queue prefix (a worker and the exporter on different queues would scale on
    nothing); Flower's login parses too."""
    every = list(r.replicadp())
    assert {settings.redis_url for *_, settings in every} == {every[0][3].redis_url}
    assert {settings.queue for *_, settings in every} == {every[0][3].queue}
    (_, _, flower, _), *_ = r.by_command("replicadp", "flower")
    credentials(r.env(flower))  # FLOWER_BASIC_AUTH as Flower's start reads it (empty: a generated password)


def test_pods_run_non_root_read_only_and_with_requests(r):
    """Every container runs as non-root, with a read-only root filesystem, no privilege escalation, no
    capabilities, the runtime's seccomp profile (Pod Security "restricted"), and requests CPU and memory; no pod
    mounts a service account token or gets Service link variables."""
    for w, spec, c in r.containers():
        pod, own = spec.get("securityContext", {}), c.get("securityContext", {})
        where = f"{w['metadata']['name']}/{c['name']}"
        assert own.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
        assert own.get("runAsUser", pod.get("runAsUser", 0)) != 0, where
        assert (own.get("seccompProfile") or pod["seccompProfile"])["type"] == "RuntimeDefault", where
        assert own["allowPrivilegeEscalation"] is False and own["readOnlyRootFilesystem"] is True, where
        assert own["capabilities"]["drop"] == ["ALL"], where
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"], where
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False, where
    for namespace in r.of("Namespace"):
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_the_model_cache_is_a_shared_volume(r):
    """Each worker keeps its Hugging Face cache and replicadp's model cache on a ReadWriteMany claim shared by
    every pod, so a new pod (a scale-up, a replacement) loads what an earlier one downloaded."""
    for w, spec, c, settings in r.workers():
        env = r.env(c)
        for path in (env["HF_HOME"], str(settings.model_cache)):
            mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            claim = r.get("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
            assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_disruption_budgets_keep_each_model_and_redis_serving(r):
    """Each model's workers, the gateway, the Redis servers and the Sentinels have a PodDisruptionBudget selecting
    exactly them: a drain takes one at a time (a worker after its request), never a model's last two at once."""
    budgets = r.of("PodDisruptionBudget")
    for w in r.workloads():
        if w["spec"].get("replicas") == 1:
            continue  # Flower, the exporter: one pod by design, nothing to keep serving beside it
        mine = [b for b in budgets if selects(b["spec"]["selector"], pod_labels(w))]
        assert len(mine) == 1, w["metadata"]["name"]
        assert all(not selects(mine[0]["spec"]["selector"], pod_labels(o)) for o in r.workloads() if o is not w)


# --- Redis ----------------------------------------------------------------------------------------------------


def redis_servers(r: Render) -> list[dict]:
    """The workloads of an in-cluster Redis (servers and Sentinels); none where the overlay uses the user's."""
    return [w for w in r.workloads() if w["spec"]["template"]["spec"]["containers"][0]["image"].startswith("redis")]


def test_only_replicadp_pods_reach_an_in_cluster_redis(renders):
    """Where Redis runs in the cluster (some overlay does), a NetworkPolicy selects its servers and Sentinels and
    admits only pods labelled part of replicadp, from this namespace: every pod that connects to Redis is, and a
    pod without the label is not."""
    inside = [r for r in renders.values() if redis_servers(r)]
    assert inside
    for r in inside:
        check_redis_policy(r, redis_servers(r))


def check_redis_policy(r: Render, servers: list[dict]) -> None:
    clients = [w for w, _, c in r.containers() if "REDIS_URL" in r.env(c)] + servers
    for server in servers:
        (policy,) = [p for p in r.of("NetworkPolicy") if selects(p["spec"]["podSelector"], pod_labels(server))]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        sources = [f for rule in policy["spec"]["ingress"] for f in rule["from"]]
        assert sources and all(set(f) == {"podSelector"} and f["podSelector"] for f in sources)
        assert all(any(selects(f["podSelector"], pod_labels(c)) for f in sources) for c in clients)
        assert not any(selects(f["podSelector"], {"app": "other"}) for f in sources)


def test_an_in_cluster_redis_url_goes_through_the_sentinels_the_render_runs(renders):
    """The REDIS_URL of an in-cluster overlay (parsed by replicadp's own parser) names each Sentinel pod of the
    render by its stable name and port, the master name the Sentinels monitor, and the servers' password for the
    master and the Sentinels; enough Redis replicas exist for the writes replicadp waits on."""
    inside = [r for r in renders.values() if redis_servers(r)]
    assert inside
    for r in inside:
        check_sentinel_url(r)


def check_sentinel_url(r: Render) -> None:
    (sentinel,) = [w for w in redis_servers(r) if "--sentinel" in w["spec"]["template"]["spec"]["containers"][0]
                   ["command"][-1]]
    secret = r.data("Secret", "replicadp-redis")
    target = connection.parse(secret["REDIS_URL"])
    name, service = sentinel["metadata"]["name"], sentinel["spec"]["serviceName"]
    port = sentinel["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert sorted(target.sentinels) == [(f"{name}-{i}.{service}", port) for i in range(sentinel["spec"]["replicas"])]
    script = sentinel["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert re.search(rf"sentinel monitor {re.escape(target.master)} ", script)
    for w in redis_servers(r):  # where a server or a new Sentinel asks for the primary
        script = w["spec"]["template"]["spec"]["containers"][0]["command"][-1]
        assert f"get-master-addr-by-name {target.master} " in script
    assert target.password == target.sentinel_password == secret["REDIS_PASSWORD"]
    (_, _, _, settings), *_ = r.workers()
    data = [w for w in r.of("StatefulSet") if w is not sentinel]
    assert sum(w["spec"]["replicas"] for w in data) - 1 >= settings.redis_replicas >= 1


def start_script(tmp_path: Path, workload: dict, pod: str, primary: str, data: Path | None = None) -> str:
    """What the workload's start script runs (its last line, `exec redis-server ...`, printed), as pod `pod` while
    the Sentinels name `primary` ("" when none answers), with redis-cli, hostname and redis-server stubbed and
    /data at `data`."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, body in {"redis-cli": '[ -n "$PRIMARY" ] || exit 1; printf "%s\\n6379\\n" "$PRIMARY"',
                       "hostname": 'echo "$POD"', "redis-server": 'echo "$@"'}.items():
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    script = workload["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    if data is not None:
        script = script.replace("/data/", f"{data}/")
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10, env={
        "PATH": f"{stubs}:/usr/bin:/bin", "REDIS_PASSWORD": "pw", "POD": pod, "PRIMARY": primary})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_in_cluster_redis_server_follows_the_primary_the_sentinels_name(renders, tmp_path):
    """A data server's start script (run with redis-cli and redis-server stubbed): on the first start, pod 0 is the
    primary and the others follow it; once the Sentinels name a primary, every other pod follows that one (a former
    primary that comes back does not take writes beside it) and the named one starts as primary."""
    for r in (r for r in renders.values() if redis_servers(r)):
        (server,) = [w for w in redis_servers(r) if w["metadata"]["name"] == "replicadp-redis"]
        name, service = server["metadata"]["name"], server["spec"]["serviceName"]
        pods = [f"{name}-{i}" for i in range(server["spec"]["replicas"])]

        def follows(pod, primary):
            found = re.search(r"--replicaof (\S+) 6379", start_script(tmp_path, server, pod, primary))
            return found and found.group(1)

        assert [follows(pod, "") for pod in pods] == [None] + [f"{pods[0]}.{service}"] * (len(pods) - 1)
        promoted = f"{pods[1]}.{service}"
        assert [follows(pod, promoted) for pod in pods] == [promoted, None] + [promoted] * (len(pods) - 2)


def test_a_sentinel_writes_its_config_once_from_the_primary_it_is_told(renders, tmp_path):
    """A Sentinel's start script (stubbed as above): a new Sentinel monitors the primary the others name (pod 0's
    server with none), under the master name of REDIS_URL, announcing its own stable name; restarted, it keeps the
    config it has (Sentinel rewrites it as the primary moves)."""
    for r in (r for r in renders.values() if redis_servers(r)):
        (sentinel,) = [w for w in redis_servers(r) if w["metadata"]["name"] == "replicadp-sentinel"]
        master = connection.parse(r.data("Secret", "replicadp-redis")["REDIS_URL"]).master
        pod = f"{sentinel['metadata']['name']}-1"
        fresh, conf = tmp_path / "fresh", tmp_path / "fresh" / "sentinel.conf"
        fresh.mkdir()
        assert start_script(tmp_path, sentinel, pod, "", fresh).split()[-1] == "--sentinel"
        lines = conf.read_text().splitlines()
        assert f"sentinel monitor {master} replicadp-redis-0.replicadp-redis 6379 2" in lines
        assert f"sentinel announce-ip {pod}.{sentinel['spec']['serviceName']}" in lines
        start_script(tmp_path, sentinel, pod, "replicadp-redis-2.replicadp-redis", fresh)
        assert conf.read_text().splitlines() == lines
        told = tmp_path / "told"
        told.mkdir()
        start_script(tmp_path, sentinel, pod, "replicadp-redis-2.replicadp-redis", told)
        told_lines = (told / "sentinel.conf").read_text().splitlines()
        assert f"sentinel monitor {master} replicadp-redis-2.replicadp-redis 6379 2" in told_lines


# --- what reaches the gateway and the exporter ----------------------------------------------------------------


def test_the_service_monitor_and_ingress_point_at_what_exists(r):
    """The ServiceMonitor selects the exporter's Service by a port it has; an Ingress routes its host to the
    gateway's Service and port, the host is one the gateway answers (its REPLICADP_ALLOWED_HOSTS, as the gateway
    reads them), and the proxy waits as long as a sync request may."""
    for monitor in r.of("ServiceMonitor"):
        (service,) = [s for s in r.of("Service") if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert service["metadata"]["name"] == "replicadp-metrics"
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert all(e["port"] in ports for e in monitor["spec"]["endpoints"])
    (_, _, gateway, _), *_ = r.by_command("replicadp", "serve-http")
    hosts = allowed_hosts(tuple(r.env(gateway)["REPLICADP_ALLOWED_HOSTS"].split()), "0.0.0.0")
    assert "replicadp-gateway" in hosts
    sync = next(p for p in cli.commands["serve-http"].params if p.name == "sync_timeout")
    for ingress in r.of("Ingress"):
        for rule in ingress["spec"]["rules"]:
            assert host_name(rule["host"]) in hosts
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                service = r.get("Service", backend["name"])
                assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
                assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(
                    r.get("Deployment", "replicadp-gateway")))
        timeout = ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-read-timeout"]
        assert float(timeout) >= float(r.env(gateway).get(sync.envvar, sync.default))
