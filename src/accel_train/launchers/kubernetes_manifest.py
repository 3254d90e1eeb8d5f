"""launcher=kubernetes: a Kubeflow TrainJob (trainer.kubeflow.org/v1alpha1, Trainer v2) or
PyTorchJob (kubeflow.org/v1, Training Operator) for this run, validated, written into the run
dir, and (`launcher.submit=true`) applied through the kubernetes client.

Every pod runs `torchrun ... -m accel_train.worker <run dir>/config.yaml`, the worker that
torchrun starts everywhere else; the operator gives each pod its node rank and the rendezvous
(PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, which torchrun reads). The run dir, with
config.yaml, lives on a PersistentVolumeClaim mounted at `launcher.mount_path` in every pod and
at the same path here, so the paths in config.yaml hold in both places.

Before anything is written, the manifest is checked against the engines' own models: a TrainJob
against the Kubeflow Trainer API's (pydantic) models, a PyTorchJob against the Training
Operator SDK's models, whose pod template is the kubernetes client's V1PodTemplateSpec. Both
model sets drop keys they do not know, so a key lost on the way through them is an error.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import re
import shlex
import types
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from accel_train.errors import UserError

log = logging.getLogger("accel_train")

KINDS = {
    # kind: (API group, version, plural, manifest file)
    "trainjob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "trainjob.yaml"),
    "pytorchjob": ("kubeflow.org", "v1", "pytorchjobs", "pytorchjob.yaml"),
}
VOLUME_NAME = "runs"  # the claim's name inside the pod spec
TRAINJOB_NODE = "node"  # the torch runtime's replicated job and container of the trainer nodes
PYTORCHJOB_CONTAINER = "pytorch"  # the container name the Training Operator requires


# ---- inputs -------------------------------------------------------------------------------


def processes_per_node(lc: DictConfig) -> int:
    if lc.gpus_per_node > 0:
        return int(lc.gpus_per_node)
    text = str(lc.nproc_per_node)
    if not text.isdigit() or int(text) < 1:
        raise UserError(
            f"launcher.nproc_per_node={lc.nproc_per_node!r}: a pod's process count must be a "
            "number >= 1 (or set launcher.gpus_per_node, which it then follows)."
        )
    return int(text)


def check(cfg: DictConfig) -> None:
    """The launcher.* values, before anything is rendered or written."""
    lc = cfg.launcher
    if lc.kind not in KINDS:
        raise UserError(
            f"launcher.kind={lc.kind!r} is not one of {', '.join(KINDS)}: `trainjob` for "
            "Kubeflow Trainer v2, `pytorchjob` for the Training Operator v1."
        )
    if not lc.image:
        raise UserError(
            "launcher=kubernetes needs launcher.image: a container image with accel-train (and "
            "your code) installed, e.g. `launcher.image=registry.example.com/accel:1.0`."
        )
    check_image(str(lc.image))
    check_counts(lc)
    if not lc.volume:
        raise UserError(
            "launcher=kubernetes needs launcher.volume: the PersistentVolumeClaim that holds "
            "the run dir, so that every pod reads config.yaml and writes checkpoints there, "
            f"e.g. `launcher.volume=runs-pvc` (mounted at launcher.mount_path={lc.mount_path})."
        )
    run_dir = Path(cfg.paths.output_dir).resolve()
    mount = Path(str(lc.mount_path))
    if not mount.is_absolute() or not run_dir.is_relative_to(mount.resolve()):
        raise UserError(
            f"the run dir {run_dir} is not under launcher.mount_path={lc.mount_path}, where "
            f"the claim launcher.volume={lc.volume} is mounted in the pods: mount the claim "
            f"here at the same path and put the run there, e.g. `hydra.run.dir="
            f"{lc.mount_path}/runs/<name>`, or set launcher.mount_path to the folder it is in."
        )


# The docker/distribution reference grammar (distribution/reference's regexp.go), which
# Kubernetes and every container runtime parse `image:` with:
#   [domain[:port]/]path-component[/path-component...][:tag][@digest]
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::{_TAG})?(?:@{_DIGEST})?")
# A Kubernetes resource quantity (cpu, memory): a number and an optional SI/binary suffix.
QUANTITY = re.compile(
    r"(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?"
)


def check_image(image: str) -> None:
    """launcher.image must parse as an image reference: the pods would otherwise fail to pull it
    (InvalidImageName) long after the job was written and submitted."""
    match = IMAGE_REFERENCE.fullmatch(image)
    if match and len(match.group("name")) <= 255:
        return
    why = "it is longer than 255 characters" if match else _image_fault(image)
    raise UserError(
        f"launcher.image={image!r} is not a container image reference ({why}). A reference is "
        "[registry[:port]/]name[:tag][@sha256:digest], with a lower-case name of letters, "
        "digits and single '.', '_' or '-' between them, e.g. "
        "`launcher.image=registry.example.com/accel:1.0`."
    )


def _image_fault(image: str) -> str:
    if not image.strip() or any(c.isspace() for c in image):
        return "it holds a space"
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    path = name.rsplit(":", 1)[0] if ":" in last else name
    if "::" in image or name.endswith(":"):
        return "an empty tag or port"
    if any(c.isupper() for c in path.split("/", 1)[-1]):
        return "upper-case letters in the name"
    return "its parts do not fit the grammar"


def check_counts(lc: DictConfig) -> None:
    """Every count and amount of a pod, before it is written into the manifest."""
    if lc.nodes < 1:
        raise UserError(f"launcher.nodes={lc.nodes}: a job needs at least one node (pod).")
    if lc.gpus_per_node < 0:
        raise UserError(
            f"launcher.gpus_per_node={lc.gpus_per_node}: the GPUs (nvidia.com/gpu) of each pod "
            "must be >= 0 (0: a CPU pod, launcher.nproc_per_node processes)."
        )
    processes_per_node(lc)
    if lc.max_restarts < 0:
        raise UserError(
            f"launcher.max_restarts={lc.max_restarts}: torchrun's restarts of a pod's workers "
            "must be >= 0 (0: none)."
        )
    if lc.omp_num_threads is not None and lc.omp_num_threads < 1:
        raise UserError(
            f"launcher.omp_num_threads={lc.omp_num_threads}: CPU threads per process must be "
            ">= 1, or null for torchrun's default."
        )
    for key, example in (("cpu", "8"), ("memory", "64Gi")):
        value = lc[key]
        if value is None:
            continue
        match = QUANTITY.fullmatch(str(value))
        if not match or float(match.group("number")) == 0:
            raise UserError(
                f"launcher.{key}={value!r} is not a positive Kubernetes quantity (a number with "
                f"an optional suffix such as m, Ki, Mi, Gi, k, M, G), e.g. "
                f"`launcher.{key}={example}`, or null for the cluster's default."
            )


def job_name(cfg: DictConfig) -> str:
    """launcher.job_name, or the run dir's name made a DNS-1123 label (what the API accepts)."""
    lc = cfg.launcher
    raw = lc.job_name or f"{cfg.name}-{Path(cfg.paths.output_dir).name}"
    name = re.sub(r"[^a-z0-9-]+", "-", str(raw).lower()).strip("-")[:63].strip("-")
    if lc.job_name and name != lc.job_name:
        raise UserError(
            f"launcher.job_name={lc.job_name!r} is not a valid Kubernetes name (lower-case "
            f"letters, digits and '-', at most 63): e.g. `launcher.job_name={name or 'run-1'}`."
        )
    return name or "accel-train"


# ---- the manifest -------------------------------------------------------------------------


def command(cfg: DictConfig, config_path: Path) -> list[str]:
    """Each pod's command: torchrun with the node count and processes fixed here; the node rank
    and the master's address come from the operator's PET_* variables."""
    lc = cfg.launcher
    return [
        "torchrun",
        f"--nnodes={lc.nodes}",
        f"--nproc-per-node={processes_per_node(lc)}",
        f"--max-restarts={lc.max_restarts}",
        "-m",
        "accel_train.worker",
        str(config_path),
    ]


def environment(lc: DictConfig) -> list[dict[str, str]]:
    env = {"PYTHONUNBUFFERED": "1"}
    if lc.omp_num_threads:
        env["OMP_NUM_THREADS"] = str(lc.omp_num_threads)
    env.update({str(k): str(v) for k, v in (lc.env or {}).items()})
    return [{"name": k, "value": v} for k, v in env.items()]


def resources(lc: DictConfig) -> dict[str, dict[str, str]]:
    amounts = {}
    if lc.cpu:
        amounts["cpu"] = str(lc.cpu)
    if lc.memory:
        amounts["memory"] = str(lc.memory)
    limits = {**amounts, **({"nvidia.com/gpu": str(lc.gpus_per_node)} if lc.gpus_per_node else {})}
    return {k: v for k, v in (("requests", amounts), ("limits", limits)) if v}


def _pod_parts(lc: DictConfig) -> dict[str, Any]:
    return {
        "volumes": [{"name": VOLUME_NAME, "persistentVolumeClaim": {"claimName": lc.volume}}],
        "mounts": [{"name": VOLUME_NAME, "mountPath": str(lc.mount_path)}],
        "secrets": [{"name": str(s)} for s in lc.image_pull_secrets],
    }


def render(cfg: DictConfig, config_path: Path) -> dict[str, Any]:
    lc = cfg.launcher
    group, version, _, _ = KINDS[lc.kind]
    metadata = {
        "name": job_name(cfg),
        "namespace": lc.namespace,
        "labels": {"app.kubernetes.io/managed-by": "accel-train"},
    }
    spec = _trainjob_spec if lc.kind == "trainjob" else _pytorchjob_spec
    return {
        "apiVersion": f"{group}/{version}",
        "kind": "TrainJob" if lc.kind == "trainjob" else "PyTorchJob",
        "metadata": metadata,
        "spec": spec(cfg, config_path),
    }


def _trainjob_spec(cfg: DictConfig, config_path: Path) -> dict[str, Any]:
    lc, pod = cfg.launcher, _pod_parts(cfg.launcher)
    trainer = {
        "image": lc.image,
        "command": command(cfg, config_path),
        "numNodes": int(lc.nodes),
        "numProcPerNode": processes_per_node(lc),  # the runtime's PET_NPROC_PER_NODE
        "env": environment(lc),
    }
    if resources(lc):
        trainer["resourcesPerNode"] = resources(lc)
    pod_spec = {
        "volumes": pod["volumes"],
        "containers": [{"name": TRAINJOB_NODE, "volumeMounts": pod["mounts"]}],
        **({"imagePullSecrets": pod["secrets"]} if pod["secrets"] else {}),
    }
    node_job = {"name": TRAINJOB_NODE, "template": {"spec": {"template": {"spec": pod_spec}}}}
    return {
        "runtimeRef": {
            "name": lc.runtime,
            "apiGroup": "trainer.kubeflow.org",
            "kind": "ClusterTrainingRuntime",
        },
        "trainer": trainer,
        # The run dir's volume and the pull secrets go into the runtime's node pods.
        "runtimePatches": [
            {
                "manager": "accel-train",
                "trainingRuntimeSpec": {
                    "template": {"spec": {"replicatedJobs": [node_job]}},
                },
            }
        ],
    }


def _pytorchjob_spec(cfg: DictConfig, config_path: Path) -> dict[str, Any]:
    lc, pod = cfg.launcher, _pod_parts(cfg.launcher)
    container = {
        "name": PYTORCHJOB_CONTAINER,
        "image": lc.image,
        "command": command(cfg, config_path),
        "env": environment(lc),
        "volumeMounts": pod["mounts"],
        **({"resources": resources(lc)} if resources(lc) else {}),
    }
    template = {
        "spec": {
            "containers": [container],
            "volumes": pod["volumes"],
            **({"imagePullSecrets": pod["secrets"]} if pod["secrets"] else {}),
        }
    }

    def replicas(count: int) -> dict[str, Any]:
        # OnFailure: a pod whose torchrun gave up (after launcher.max_restarts) starts again
        # and resumes from last.pt (config.yaml says resume: auto).
        pod = copy.deepcopy(template)  # one copy each: no YAML anchors in the manifest
        return {"replicas": count, "restartPolicy": "OnFailure", "template": pod}

    specs = {"Master": replicas(1)}
    if lc.nodes > 1:
        specs["Worker"] = replicas(int(lc.nodes) - 1)
    return {
        "nprocPerNode": str(processes_per_node(lc)),
        "runPolicy": {"cleanPodPolicy": "None"},
        "pytorchReplicaSpecs": specs,
    }


# ---- validation against the engines' models -----------------------------------------------


def validate(manifest: dict[str, Any]) -> None:
    """Raise a UserError naming the first key the engine's models refuse or do not know."""
    if manifest["kind"] == "TrainJob":
        models = _import("kubeflow_trainer_api.models", "kubeflow-trainer-api")
        try:
            parsed = models.TrainerV1alpha1TrainJob.from_dict(manifest)
        except Exception as err:  # noqa: BLE001 - pydantic's ValidationError
            raise UserError(_refused("TrainJob", "Kubeflow Trainer API", err)) from None
        back = parsed.to_dict()
    else:
        client = _import("kubeflow.training.api_client", "kubeflow-training")
        api = client.ApiClient()
        try:
            response = types.SimpleNamespace(data=json.dumps(manifest))
            parsed = api.deserialize(response, "KubeflowOrgV1PyTorchJob")
        except Exception as err:  # noqa: BLE001 - the models' ValueError/TypeError
            raise UserError(_refused("PyTorchJob", "Training Operator", err)) from None
        back = api.sanitize_for_serialization(parsed)
    lost = _lost_keys(manifest, back)
    if lost:
        raise UserError(
            f"the {manifest['kind']} manifest has keys its API does not know: "
            f"{', '.join(lost)}. The engine would drop them silently: remove or rename them "
            "(launcher.* sets the supported ones; docs/kubernetes.md lists them)."
        )


def _refused(kind: str, api: str, err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"the {kind} manifest does not match the {api}'s schema: {text[:500]}."


def _lost_keys(sent: Any, back: Any, path: str = "") -> list[str]:
    """Keys of `sent` missing from `back` (the models' round trip), as dotted paths."""
    if isinstance(sent, dict):
        lost = []
        for key, value in sent.items():
            here = f"{path}.{key}" if path else str(key)
            if not isinstance(back, dict) or key not in back:
                lost.append(here)
            else:
                lost += _lost_keys(value, back[key], here)
        return lost
    if isinstance(sent, list) and isinstance(back, list):
        return [
            k for i, (a, b) in enumerate(zip(sent, back)) for k in _lost_keys(a, b, f"{path}[{i}]")
        ]
    return []


def _import(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"launcher=kubernetes needs the {package} package to check the manifest: install "
            "it with `pip install 'accel-train[kubernetes]'`."
        ) from None


# ---- writing and submitting ---------------------------------------------------------------


def write(cfg: DictConfig, manifest: dict[str, Any]) -> Path:
    run_dir = Path(cfg.paths.output_dir)
    path = run_dir / KINDS[cfg.launcher.kind][3]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(yaml.safe_dump(manifest, sort_keys=False))
    os.replace(tmp, path)
    return path


def follow_commands(manifest: dict[str, Any]) -> list[str]:
    kind, meta = manifest["kind"].lower(), manifest["metadata"]
    name, ns = meta["name"], shlex.quote(meta["namespace"])
    label = (
        f"jobset.sigs.k8s.io/jobset-name={name}"
        if kind == "trainjob"
        else f"training.kubeflow.org/job-name={name}"
    )
    return [
        f"status: kubectl get {kind} {name} -n {ns}",
        f"pods:   kubectl get pods -n {ns} -l {label}",
        f"logs:   kubectl logs -n {ns} -l {label} -f --max-log-requests=16",
        f"delete: kubectl delete {kind} {name} -n {ns}",
    ]


def submit(lc: DictConfig, manifest: dict[str, Any]) -> None:
    """Create the job through the kubernetes client (kubeconfig, or the in-cluster config)."""
    k8s = _import("kubernetes", "kubernetes")
    group, version, plural, _ = KINDS[lc.kind]
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST") and not lc.context:
            k8s.config.load_incluster_config()
        else:
            k8s.config.load_kube_config(context=lc.context)
    except Exception as err:  # noqa: BLE001 - ConfigException, or a kubeconfig it cannot read
        raise UserError(
            f"launcher.submit=true: no usable Kubernetes configuration ({_short(err)}). Point "
            "KUBECONFIG at your cluster's kubeconfig (or pick launcher.context), or leave "
            "launcher.submit=false and `kubectl apply -f` the manifest in the run dir."
        ) from None
    api = k8s.client.CustomObjectsApi()
    try:
        api.create_namespaced_custom_object(group, version, lc.namespace, plural, manifest)
    except k8s.client.ApiException as err:
        raise UserError(_api_refusal(lc, manifest, err)) from None
    except Exception as err:  # noqa: BLE001 - urllib3's connection errors
        raise UserError(
            f"launcher.submit=true: the Kubernetes API server did not answer ({_short(err)}). "
            "Check `kubectl cluster-info` from this machine; the manifest is in the run dir."
        ) from None


def _api_refusal(lc: DictConfig, manifest: dict[str, Any], err: Any) -> str:
    name = manifest["metadata"]["name"]
    try:
        message = json.loads(err.body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        message = str(err.reason)
    hint = {
        404: f"is the {manifest['kind']} CRD installed (`kubectl get crd "
        f"{KINDS[lc.kind][2]}.{KINDS[lc.kind][0]}`), and does namespace {lc.namespace} exist?",
        409: f"a {manifest['kind']} named {name} exists already: delete it, or set "
        "launcher.job_name to another name.",
        403: "your account may not create it there: ask for the RBAC rights, or pick another "
        "launcher.namespace.",
    }.get(err.status, "fix what the API server says, or apply the manifest yourself.")
    return (
        f"the Kubernetes API server refused the {manifest['kind']} {name} (HTTP {err.status}: "
        f"{message or err.reason}); {hint}"
    )


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:300].rstrip(".")


def launch(cfg: DictConfig, config_path: Path) -> dict[str, Any]:
    """Render and check the manifest (nothing written yet), then the caller writes config.yaml
    and this writes the manifest and, with submit=true, applies it."""
    manifest = render(cfg, config_path)
    validate(manifest)
    return manifest


def finish(cfg: DictConfig, manifest: dict[str, Any]) -> Path:
    lc = cfg.launcher
    path = write(cfg, manifest)
    if not lc.submit:
        print(path.read_text())
        log.info(
            "launcher.submit=false: wrote %s, submitted nothing (kubectl apply -f %s)", path, path
        )
        return path
    submit(lc, manifest)
    lines = "\n  ".join(follow_commands(manifest))
    print(f"submitted {manifest['kind']} {manifest['metadata']['name']} ({path})\n  {lines}")
    return path
