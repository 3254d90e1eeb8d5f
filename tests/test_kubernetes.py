"""launcher=kubernetes: the TrainJob / PyTorchJob manifests accel-train writes, checked against
the engines' own models, run locally, and submitted.

No Kubernetes API server can run on this machine. What is real here: the manifests (compared
with golden files, and validated by the Kubeflow Trainer API's and the Training Operator SDK's
models, the pod template by the kubernetes client's); the pods' exact command and environment,
run as two local processes with the variables the operator would set; and the kubernetes
client's request for submit=true, sent to a stub API server on 127.0.0.1 that records it. The
stub is NOT a real cluster: it shows what is sent, not that a cluster accepts and runs it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from helpers import BIN, check_ok, free_port

from accel_train.errors import UserError
from accel_train.launchers.kubernetes_manifest import validate

GOLDEN = Path(__file__).parent / "golden"
RUN = [
    "model=mlp",
    "dataset=synthetic",
    "dataset.num_train=128",
    "dataset.num_test=32",
    "loader.batch_size=16",
    "trainer.max_steps=4",
    "trainer.progress=none",
    "strategy=ddp",
]


def manifest_args(mount: Path, kind: str, *extra: str) -> list[str]:
    return [
        *RUN,
        "launcher=kubernetes",
        f"launcher.kind={kind}",
        "launcher.image=registry.example.com/accel:1.0",
        "launcher.nodes=2",
        "launcher.nproc_per_node=1",
        "launcher.memory=8Gi",
        "launcher.cpu=4",
        "launcher.volume=runs-pvc",
        f"launcher.mount_path={mount}",
        "launcher.image_pull_secrets=[regcred]",
        "+launcher.env.HF_HOME=/runs/hf",
        f"hydra.run.dir={mount}/runs/exp1",
        *extra,
    ]


def without(args: list[str], changes: list[str]) -> list[str]:
    """args with `changes` in place of the values they set (Hydra refuses a key given twice)."""
    keys = {c.split("=")[0] for c in changes}
    return [a for a in args if a.split("=")[0] not in keys] + changes


def normalised(path: Path, mount: Path) -> str:
    """The manifest with this test's mount path written as <mount>."""
    return path.read_text().replace(str(mount), "<mount>")


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_manifest_matches_golden_and_validates(kind, run_cli, tmp_path):
    mount = tmp_path / "mnt"
    result = run_cli(manifest_args(mount, kind))
    check_ok(result)
    run_dir = mount / "runs" / "exp1"
    path = run_dir / f"{kind}.yaml"
    assert normalised(path, mount) == (GOLDEN / f"{kind}.yaml").read_text()
    assert "submitted nothing" in result.stdout + result.stderr
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["resume"] == "auto"  # a restarted pod continues from last.pt
    manifest = yaml.safe_load(path.read_text())
    validate(manifest)  # the engine's models take it as written
    assert not (run_dir / "summary.json").exists()  # written, not run


def test_validation_catches_unknown_and_wrong_fields(run_cli, tmp_path):
    mount = tmp_path / "mnt"
    check_ok(run_cli(manifest_args(mount, "trainjob")))
    check_ok(run_cli([*manifest_args(mount, "pytorchjob"), f"hydra.run.dir={mount}/runs/pt"]))
    trainjob = yaml.safe_load((mount / "runs" / "exp1" / "trainjob.yaml").read_text())
    pytorchjob = yaml.safe_load((mount / "runs" / "pt" / "pytorchjob.yaml").read_text())

    def refused(manifest: dict, *texts: str) -> None:
        with pytest.raises(UserError) as err:
            validate(manifest)
        for text in texts:
            assert text in str(err.value), (text, str(err.value))

    bad = copy.deepcopy(trainjob)
    bad["spec"]["trainer"]["gpusPerNode"] = 8  # not a TrainJob key: the API would drop it
    refused(bad, "spec.trainer.gpusPerNode", "does not know")
    bad = copy.deepcopy(trainjob)
    bad["spec"]["trainer"]["numNodes"] = "two"
    refused(bad, "numNodes", "Kubeflow Trainer API")
    bad = copy.deepcopy(pytorchjob)
    pod = bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    pod["containers"][0]["volumeMount"] = []  # a typo inside the kubernetes pod template
    refused(bad, "spec.pytorchReplicaSpecs.Master.template.spec.containers[0].volumeMount")
    bad = copy.deepcopy(pytorchjob)
    del bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"]
    refused(bad, "PyTorchJob", "name")


def test_the_pods_command_runs_locally_as_two_nodes(run_cli, tmp_path):
    """Each pod's exact command and environment, as two local processes given the variables
    the operator sets (PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT): the run finishes."""
    mount = tmp_path / "mnt"
    check_ok(run_cli(manifest_args(mount, "trainjob")))
    run_dir = mount / "runs" / "exp1"
    trainer = yaml.safe_load((run_dir / "trainjob.yaml").read_text())["spec"]["trainer"]
    pytorchjob = run_cli([*manifest_args(mount, "pytorchjob"), f"hydra.run.dir={run_dir}"])
    check_ok(pytorchjob)  # the same command in both kinds (config.yaml written again, same)
    container = yaml.safe_load((run_dir / "pytorchjob.yaml").read_text())["spec"][
        "pytorchReplicaSpecs"
    ]["Master"]["template"]["spec"]["containers"][0]
    assert container["command"] == trainer["command"]
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "RANK"))}
    base["PATH"] = f"{BIN}{os.pathsep}{base.get('PATH', '')}"  # the image's torchrun
    base["OMP_NUM_THREADS"] = "1"
    base.update({e["name"]: e["value"] for e in trainer["env"]})
    procs = []
    for rank in (0, 1):
        env = {
            **base,
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                trainer["command"],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (2, 4)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best.pt", "last.pt"]


class StubApiServer:
    """NOT a real cluster: an HTTP server on 127.0.0.1 that answers the kubernetes client's
    create call the way the API server does (201 and the object; 409 for a name it has) and
    records each request."""

    def __init__(self):
        self.requests: list[dict] = []
        created: set[str] = set()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(
                    {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
                )
                name = body["metadata"]["name"]
                if name in created:
                    self._answer(
                        409,
                        {
                            "kind": "Status",
                            "status": "Failure",
                            "reason": "AlreadyExists",
                            "code": 409,
                            "message": f'trainjobs.trainer.kubeflow.org "{name}" already exists',
                        },
                    )
                    return
                created.add(name)
                self._answer(201, body)

            def _answer(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {"name": "stub", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}
                    ],
                    "users": [{"name": "me", "user": {"token": "stub-token"}}],
                    "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "me"}}],
                    "current-context": "stub",
                }
            )
        )
        return path


def test_submit_applies_through_the_kubernetes_client(run_cli, tmp_path):
    stub = StubApiServer()
    try:
        env = {"KUBECONFIG": str(stub.kubeconfig(tmp_path / "kubeconfig"))}
        mount = tmp_path / "mnt"
        args = [
            *manifest_args(mount, "trainjob", "launcher.namespace=team-a"),
            "launcher.submit=true",
        ]
        result = run_cli(args, env=env)
        check_ok(result)
        run_dir = mount / "runs" / "exp1"
        [request] = stub.requests
        assert request["path"] == "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs"
        assert request["auth"] == "Bearer stub-token"
        assert request["body"] == yaml.safe_load((run_dir / "trainjob.yaml").read_text())
        out = result.stdout
        assert "submitted TrainJob train-exp1" in out
        assert "kubectl get trainjob train-exp1 -n team-a" in out
        assert "kubectl logs -n team-a -l jobset.sigs.k8s.io/jobset-name=train-exp1" in out
        # The same name again: the API server's refusal, in one paragraph.
        again = run_cli(
            [*args, f"hydra.run.dir={mount}/runs/exp2", "launcher.job_name=train-exp1"], env=env
        )
        assert again.returncode == 2, again.stdout + again.stderr
        assert "HTTP 409" in again.stderr and "launcher.job_name" in again.stderr
        assert "Traceback" not in again.stderr
        assert (mount / "runs" / "exp2" / "trainjob.yaml").is_file()  # kept for kubectl apply
    finally:
        stub.server.shutdown()


def test_submit_without_a_cluster_is_one_paragraph(run_cli, tmp_path):
    mount = tmp_path / "mnt"
    missing = tmp_path / "no-kubeconfig"
    result = run_cli(
        [*manifest_args(mount, "pytorchjob"), "launcher.submit=true"],
        env={"KUBECONFIG": str(missing)},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "KUBECONFIG" in result.stderr and "launcher.submit=false" in result.stderr
    assert "Traceback" not in result.stderr


BAD = {
    "no_image": (["launcher.image=null"], ["launcher.image"]),
    "no_volume": (["launcher.volume=null"], ["launcher.volume", "PersistentVolumeClaim"]),
    "no_nodes": (["launcher.nodes=0"], ["launcher.nodes=0"]),
    "run_dir_off_the_volume": (
        ["launcher.mount_path=/elsewhere"],
        ["launcher.mount_path=/elsewhere", "hydra.run.dir"],
    ),
    "unknown_kind": (["launcher.kind=mpijob"], ["launcher.kind='mpijob'", "trainjob"]),
    "bad_job_name": (["launcher.job_name=My_Run"], ["launcher.job_name='My_Run'", "my-run"]),
    "bad_image": (
        ["launcher.image='Bad Image::x'"],
        ["launcher.image='Bad Image::x' is not a container image reference", "registry"],
    ),
    "negative_gpus": (["launcher.gpus_per_node=-2"], ["launcher.gpus_per_node=-2", ">= 0"]),
    # The strategies' refusals name this launcher's keys with the user's values (2 nodes of 8,
    # not "launcher.nproc_per_node=16 and launcher.nnodes=2"), and count 2 x 3 processes.
    "single_on_two_nodes": (
        ["strategy=single", "launcher.nproc_per_node=8"],
        ["launcher.nodes=2 and launcher.nproc_per_node=8", "launcher.nodes=1"],
    ),
    "tp_not_dividing": (
        ["strategy=fsdp", "strategy.tp=4", "launcher.nproc_per_node=3"],
        [
            "strategy.tp=4 does not divide the 6 processes",
            "launcher.nproc_per_node (x launcher.nodes)",
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_are_refused_before_anything_is_written(name, run_cli, tmp_path):
    args, texts = BAD[name]
    mount = tmp_path / "mnt"
    result = run_cli(without(manifest_args(mount, "trainjob"), args))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for text in texts:
        assert text in result.stderr, (text, result.stderr)
    run_dir = mount / "runs" / "exp1"
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "trainjob.yaml").exists()


def test_no_strategy_named_trains_the_nodes_with_ddp(run_cli, tmp_path):
    """2 pods and no strategy: DDP (as torchrun and Lightning), said in one line and written
    into config.yaml, which the pods read."""
    mount = tmp_path / "mnt"
    args = [a for a in manifest_args(mount, "trainjob") if a != "strategy=ddp"]
    result = run_cli(args)
    check_ok(result)
    said = "no strategy named and 2 processes: training with strategy=ddp"
    assert said in result.stdout + result.stderr
    config = yaml.safe_load((mount / "runs" / "exp1" / "config.yaml").read_text())
    assert config["strategy"]["name"] == "ddp"
