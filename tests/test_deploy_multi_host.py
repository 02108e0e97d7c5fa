"""The multi-host deploy files: the Kubernetes manifests (a LeaderWorkerSet replica over two
hosts, its Service and ConfigMap) checked against schemas of the fields they use and for
consistency (ports, labels, GPUs against TP x PP, volumes, flags the daemon knows); the Ray
systemd units and the daemon's drop-in, as systemd reads them."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from pydaemon.entrypoints.cli import build_parser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kubernetes" / "pagedd-multi-host.yaml"
SYSTEMD = ROOT / "deploy" / "systemd"

# The Kubernetes API's shapes for the fields these manifests use (a subset of the OpenAPI
# schemas of core/v1 and leaderworkerset.x-k8s.io/v1; unknown fields are refused, so a typo
# in a key is an error as kubectl's strict validation makes it).
_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {"name": _NAME, "labels": _LABELS},
}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_CONTAINER = {
    "type": "object",
    "required": ["name", "image"],
    "additionalProperties": False,
    "properties": {
        "name": _NAME,
        "image": {"type": "string"},
        "command": {"type": "array", "items": {"type": "string"}},
        "args": {"type": "array", "items": {"type": "string"}},
        "env": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "value": {"type": "string"},
                    "valueFrom": {"type": "object"},
                },
            },
        },
        "ports": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["containerPort"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "maxLength": 15},
                    "containerPort": _PORT,
                },
            },
        },
        "resources": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"limits": _LABELS, "requests": _LABELS},
        },
        "readinessProbe": {"type": "object"},
        "startupProbe": {"type": "object"},
        "livenessProbe": {"type": "object"},
        "volumeMounts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "mountPath"],
                "additionalProperties": False,
                "properties": {
                    "name": _NAME,
                    "mountPath": {"type": "string"},
                    "readOnly": {"type": "boolean"},
                },
            },
        },
    },
}
_POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "additionalProperties": False,
    "properties": {
        "metadata": {"type": "object", "properties": {"labels": _LABELS}},
        "spec": {
            "type": "object",
            "required": ["containers"],
            "additionalProperties": False,
            "properties": {
                "containers": {"type": "array", "minItems": 1, "items": _CONTAINER},
                "volumes": {
                    "type": "array",
                    "items": {"type": "object", "required": ["name"]},
                },
            },
        },
    },
}
SCHEMAS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["leaderWorkerTemplate"],
                "additionalProperties": False,
                "properties": {
                    "replicas": {"type": "integer", "minimum": 0},
                    "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                    "leaderWorkerTemplate": {
                        "type": "object",
                        "required": ["size", "workerTemplate"],
                        "additionalProperties": False,
                        "properties": {
                            "size": {"type": "integer", "minimum": 1},
                            "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
                            "leaderTemplate": _POD_TEMPLATE,
                            "workerTemplate": _POD_TEMPLATE,
                        },
                    },
                },
            },
        },
    },
    ("v1", "Service"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["selector", "ports"],
                "additionalProperties": False,
                "properties": {
                    "selector": _LABELS,
                    "ports": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["port"],
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "port": _PORT,
                                "targetPort": {"type": ["string", "integer"]},
                            },
                        },
                    },
                },
            },
        },
    },
    ("v1", "ConfigMap"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "data"],
        "properties": {"metadata": _METADATA, "data": _LABELS},
    },
}


def _documents() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {d["kind"]: d for d in docs}


def _pods() -> dict[str, dict]:
    template = _documents()["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    return {"leader": template["leaderTemplate"], "worker": template["workerTemplate"]}


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _flag(command: str, name: str) -> str:
    match = re.search(rf"{name}[= ](\S+)", command)
    assert match, f"{name} missing from: {command}"
    return match.group(1)


def test_every_document_matches_its_schema():
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "LeaderWorkerSet", "Service"]
    for doc in docs:
        schema = SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        assert schema is not None, f"no schema for {doc['apiVersion']} {doc['kind']}"
        jsonschema.validate(doc, schema)


def test_the_schema_catches_a_misspelt_key():
    doc = _documents()["LeaderWorkerSet"]
    doc["spec"]["leaderWorkerTemplate"]["sise"] = doc["spec"]["leaderWorkerTemplate"].pop("size")
    with pytest.raises(jsonschema.ValidationError, match="size"):
        jsonschema.validate(doc, SCHEMAS[("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")])


def test_the_service_reaches_the_leaders_grpc_and_metrics_ports():
    docs = _documents()
    leader = _pods()["leader"]
    labels = leader["metadata"]["labels"]
    service = docs["Service"]["spec"]
    assert service["selector"].items() <= labels.items(), "the Service selects no leader"
    assert not service["selector"].items() <= _pods()["worker"]["metadata"]["labels"].items()
    ports = _ports(leader["spec"]["containers"][0])
    for port in service["ports"]:
        assert port["targetPort"] in ports, port
        assert ports[port["targetPort"]] == port["port"]
    probe_port = leader["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"]
    assert probe_port == ports["grpc"]


def test_daemon_flags_parse_and_ranks_match_the_gpus():
    docs = _documents()
    size = docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["size"]
    leader = _pods()["leader"]["spec"]["containers"][0]
    command = leader["args"][0]
    command = command[command.index("pagedd serve") :]
    args = build_parser().parse_args(shlex.split(command)[1:])  # flags the daemon knows
    assert args.distributed_executor_backend == "ray"
    assert str(_ports(leader)["grpc"]) == _flag(command, "--port")
    assert str(_ports(leader)["metrics"]) == _flag(command, "--metrics-port")
    gpus = [
        int(pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for pod in _pods().values()
    ]
    assert len(set(gpus)) == 1, "leader and worker pods must hold as many GPUs"
    assert args.tensor_parallel_size * args.pipeline_parallel_size == size * gpus[0]
    assert args.tensor_parallel_size <= gpus[0], "a tensor-parallel group crosses hosts"


def test_ray_ports_agree_between_the_head_and_the_worker():
    pods = _pods()
    head = pods["leader"]["spec"]["containers"][0]
    worker = pods["worker"]["spec"]["containers"][0]
    head_cmd, worker_cmd = head["args"][0].split("&&")[0], worker["args"][0]
    gcs = _flag(head_cmd, "--port")
    assert _flag(worker_cmd, "--address") == f"$(LWS_LEADER_ADDRESS):{gcs}"
    assert str(_ports(head)["ray-gcs"]) == gcs
    for flag, name in (
        ("--node-manager-port", "ray-node"),
        ("--object-manager-port", "ray-object"),
    ):
        assert _flag(head_cmd, flag) == _flag(worker_cmd, flag)
        assert str(_ports(head)[name]) == _flag(head_cmd, flag) == str(_ports(worker)[name])
    for flag in ("--min-worker-port", "--max-worker-port"):
        assert _flag(head_cmd, flag) == _flag(worker_cmd, flag)
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert env["RAY_ADDRESS"] == f"127.0.0.1:{gcs}"
    for container in (head, worker):
        names = {e["name"] for e in container["env"]}
        assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= names


def test_every_mounted_volume_is_defined_and_the_model_is_on_every_host():
    docs = _documents()
    config = yaml.safe_load(docs["ConfigMap"]["data"]["pagedd.toml"].replace(" = ", ": "))
    for role, pod in _pods().items():
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        mounts = {}
        for container in pod["spec"]["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{role}: volume {mount['name']} undefined"
                mounts[mount["mountPath"]] = mount["name"]
        # Each rank loads its part of the weights on its own host: the same path everywhere.
        assert any(config["model"].startswith(path + "/") for path in mounts), role
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]


def _sections(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = ""
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            out[current] = []
        else:
            out[current].append(line)
    return out


@pytest.mark.parametrize("name", ["ray-head.service", "ray-worker.service"])
def test_ray_units_use_the_ports_the_manifests_use(name):
    s = _sections(SYSTEMD / name)
    start = next(line for line in s["Service"] if line.startswith("ExecStart="))
    worker_args = _pods()["worker"]["spec"]["containers"][0]["args"][0]
    for flag in ("--node-manager-port", "--object-manager-port", "--min-worker-port"):
        assert _flag(start, flag) == _flag(worker_args, flag)
    assert "--block" in start  # systemd supervises the Ray node itself
    assert any(line.startswith("StartLimitBurst=") for line in s["Unit"])


def test_daemon_drop_in_joins_the_local_head():
    s = _sections(SYSTEMD / "pagedd@.service.d" / "ray.conf")
    assert "Requires=ray-head.service" in s["Unit"] and "After=ray-head.service" in s["Unit"]
    head = _sections(SYSTEMD / "ray-head.service")
    start = next(line for line in head["Service"] if line.startswith("ExecStart="))
    temp_dir = _flag(start, "--temp-dir")
    assert f"ReadWritePaths={temp_dir}" in s["Service"]


@pytest.mark.parametrize("name", ["ray-head.service", "ray-worker.service"])
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_finds_no_misplaced_key(name, tmp_path):
    (tmp_path / name).write_text((SYSTEMD / name).read_text())
    run = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / name)], capture_output=True, text=True
    )
    complaints = [
        line
        for line in (run.stdout + run.stderr).splitlines()
        if "Unknown key" in line or "ignoring" in line or "Unknown section" in line
    ]
    assert complaints == []
