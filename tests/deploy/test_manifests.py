"""Generated manifests, checked without a cluster: the real schemas, QoS, the key's mount, the
Gramine template, and the CLI's files and errors."""

from __future__ import annotations

import base64
import copy
import os
import shutil
import stat
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from ringtrain.cli import main as cli
from ringtrain.deploy import gramine, manifests, sizing
from ringtrain.deploy.render import kustomization, to_yaml
from ringtrain.deploy.spec import TARGETS, JobSpec
from ringtrain.errors import ConfigError
from ringtrain.runtime import environment
from ringtrain.security import keys

from . import operators, schemas

KEY = bytes(range(32))
BASE = {
    "name": "mnist",
    "image": "registry.example/mnist:1",
    "command": ["python", "/app/train.py", "--epochs", "3"],
    "replicas": 3,
    "slots": 2,
    "cpus": 4,
    "memory": "8Gi",
}
VARIANTS = {
    "plain": {},
    "secure": {"secure": True, "settings": {"compression": "fp16"}},
    "sgx": {
        "sgx": True,
        "model_params": 25_000_000,
        "batch_size": 32,
        "sample_bytes": 3 * 224**2 * 4,
    },
    "durable": {"settings": {"checkpoint_dir": "/ckpt", "grace_period_s": 44.5}},
}


def spec_of(variant: str, **more: Any) -> JobSpec:
    return JobSpec.from_mapping({**BASE, **VARIANTS[variant], **more})


def pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod spec in ``docs`` (each replica type's template)."""
    out = []
    for d in docs:
        if d["kind"] == "PyTorchJob":
            out += [r["template"]["spec"] for r in d["spec"]["pytorchReplicaSpecs"].values()]
        elif d["kind"] == "MPIJob":
            out += [r["template"]["spec"] for r in d["spec"]["mpiReplicaSpecs"].values()]
        elif d["kind"] == "TrainingRuntime":
            for rj in d["spec"]["template"]["spec"]["replicatedJobs"]:
                out.append(rj["template"]["spec"]["template"]["spec"])
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_manifest_validates_against_its_schema(target: str, variant: str) -> None:
    spec = spec_of(variant)
    docs = manifests.generate(spec, target, KEY)
    kinds = [d["kind"] for d in docs]
    expected = {
        "pytorchjob": ["PyTorchJob"],
        "mpijob": ["MPIJob"],
        "trainjob": ["TrainingRuntime", "TrainJob"],
    }[target]
    assert kinds == (["Secret"] if spec.sealed else []) + expected
    for doc in docs:
        # What kubectl would send: the YAML text, read back.
        sent = yaml.safe_load(to_yaml([doc]))
        assert schemas.errors(sent) == [], doc["kind"]


def test_the_validator_catches_a_misspelt_field_and_a_wrong_type() -> None:
    """The closed CRD schemas are what make the check worth having: typos fail."""
    job = manifests.pytorchjob(spec_of("secure"))
    bad = copy.deepcopy(job)
    container = bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")
    assert any("volumeMount" in e for e in schemas.errors(bad))
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "two"
    assert any("replicas" in e for e in schemas.errors(bad))
    secret = manifests.secret(spec_of("secure"), KEY)
    secret["metadata"]["labelz"] = {}
    assert any("labelz" in e for e in schemas.errors(secret))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("target", TARGETS)
def test_pods_are_guaranteed_with_whole_cpus_and_no_fsgroup(target: str, variant: str) -> None:
    spec = spec_of(variant)
    for pod in pods(manifests.generate(spec, target, KEY)):
        # fsGroup would make the key file 0440 (kubernetes#57923), which ringtrain refuses.
        assert "fsGroup" not in pod.get("securityContext", {})
        for c in pod["containers"]:
            res = c["resources"]
            assert res["requests"] == res["limits"], c["name"]
            assert str(int(res["requests"]["cpu"])) == res["requests"]["cpu"]
    rank_pods = [c for p in pods(manifests.generate(spec, target, KEY)) for c in p["containers"]]
    rank_pods = [c for c in rank_pods if c["name"] != "launcher"]
    for c in rank_pods:
        assert c["resources"]["limits"]["cpu"] == "4"
        assert c["resources"]["limits"]["memory"] == "8Gi"
        if variant == "sgx":
            limits = c["resources"]["limits"]
            assert limits[manifests.SGX_ENCLAVE] == "1"
            assert limits[manifests.SGX_PROVISION] == "1"
            epc = sizing.plan(spec).enclave_bytes * spec.slots
            assert limits[manifests.SGX_EPC] == f"{epc >> 20}Mi"


@pytest.mark.parametrize("target", TARGETS)
def test_every_targets_pods_never_restart_and_its_jobs_never_retry(target: str) -> None:
    """docs/deploy.md, "What every pod gets": a restarted rank cannot rejoin the ring, so a
    failed pod fails the job, on every target."""
    docs = manifests.generate(spec_of("plain"), target, KEY)
    policies: list[tuple[Any, Any]] = []  # (restartPolicy, backoffLimit) of each pod template
    for d in docs:
        if d["kind"] in ("PyTorchJob", "MPIJob"):
            # The operators take restartPolicy from the replica spec, backoffLimit from runPolicy.
            replicas = d["spec"][
                "pytorchReplicaSpecs" if d["kind"] == "PyTorchJob" else "mpiReplicaSpecs"
            ]
            limit = d["spec"]["runPolicy"]["backoffLimit"]
            policies += [(r["restartPolicy"], limit) for r in replicas.values()]
        elif d["kind"] == "TrainingRuntime":
            for rj in d["spec"]["template"]["spec"]["replicatedJobs"]:
                job = rj["template"]["spec"]
                policies.append((job["template"]["spec"]["restartPolicy"], job["backoffLimit"]))
    assert len(policies) == len(pods(docs)) > 0
    assert set(policies) == {("Never", 0)}


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_and_pod_carries_the_jobs_labels(target: str) -> None:
    """docs/deploy.md, "What every pod gets": one instance label selects one job's objects and
    pods; the component says which part each is."""
    docs = manifests.generate(spec_of("secure"), target, KEY)
    components = []
    for d in docs:
        templates = []
        if d["kind"] in ("PyTorchJob", "MPIJob"):
            key = "pytorchReplicaSpecs" if d["kind"] == "PyTorchJob" else "mpiReplicaSpecs"
            templates = [r["template"] for r in d["spec"][key].values()]
        elif d["kind"] == "TrainingRuntime":
            jobs = d["spec"]["template"]["spec"]["replicatedJobs"]
            templates = [rj["template"]["spec"]["template"] for rj in jobs]
        for labels in [d["metadata"]["labels"]] + [t["metadata"]["labels"] for t in templates]:
            assert labels["app.kubernetes.io/name"] == "ringtrain"
            assert labels["app.kubernetes.io/instance"] == "mnist"
            components.append(labels["app.kubernetes.io/component"])
    assert len(components) == len(docs) + len(pods(docs))
    expected = {
        "pytorchjob": ["key", "job", "master", "worker"],
        "mpijob": ["key", "job", "launcher", "worker"],
        "trainjob": ["key", "runtime", "node", "job"],
    }[target]
    assert components == expected


@pytest.mark.parametrize("target", TARGETS)
def test_secure_pods_mount_the_key_read_only_0400_where_ranks_run(target: str) -> None:
    docs = manifests.generate(spec_of("secure"), target, KEY)
    for pod in pods(docs):
        container = pod["containers"][0]
        if container["name"] == "launcher":  # mpirun's pod runs no rank: no key there
            assert "volumes" not in pod
            continue
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == manifests.secret_name(spec_of("secure"))
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": volume["name"], "mountPath": manifests.KEY_DIR, "readOnly": True}
    text = to_yaml(docs)
    assert "defaultMode: 0400\n" in text  # octal, as people write it
    for pod in pods([yaml.safe_load(d) for d in text.split("\n---\n") if "Secret" not in d]):
        for v in pod.get("volumes", []):
            if "secret" in v:
                assert v["secret"]["defaultMode"] == 0o400  # and Kubernetes reads it as 256


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("shm", "size"), [(None, "4Gi"), ("6Gi", "6Gi"), ("1.5Gi", "1.5Gi")])
def test_every_rank_pod_gets_a_memory_backed_dev_shm_of_its_size(
    target: str, variant: str, shm: str | None, size: str
) -> None:
    """Not the runtime's 64 MiB: an emptyDir in memory at /dev/shm, half the pod's memory (8Gi)
    unless ``shm`` says otherwise; mpirun's pod, which runs no rank, gets none."""
    docs = manifests.generate(spec_of(variant, **({"shm": shm} if shm else {})), target, KEY)
    rank_pods = 0
    for pod in pods(docs):
        container = pod["containers"][0]
        if container["name"] == "launcher":
            assert "volumes" not in pod and "volumeMounts" not in container
            continue
        rank_pods += 1
        (volume,) = [v for v in pod["volumes"] if "emptyDir" in v]
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": size}
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": volume["name"], "mountPath": "/dev/shm"}
    assert rank_pods == {"pytorchjob": 2, "mpijob": 1, "trainjob": 1}[target]
    for doc in docs:
        assert schemas.errors(yaml.safe_load(to_yaml([doc]))) == [], doc["kind"]


@pytest.mark.parametrize(
    ("memory", "half"),
    [("8Gi", "4Gi"), ("3Gi", "1536Mi"), ("1.5Gi", "768Mi"), ("1G", "500000000"), ("1001", "500")],
)
def test_the_default_dev_shm_is_half_the_pods_memory_in_whole_bytes(memory: str, half: str) -> None:
    assert spec_of("plain", memory=memory).shm_size == half


def test_the_secret_holds_the_key_as_a_key_file_does(tmp_path: Path) -> None:
    secret = yaml.safe_load(to_yaml([manifests.secret(spec_of("secure"), KEY)]))
    data = base64.b64decode(secret["data"][manifests.KEY_ITEM])
    # What the kubelet writes into the pod: this content, mode 0400, owned by root.
    path = tmp_path / manifests.KEY_ITEM
    path.write_bytes(data)
    path.chmod(0o400)
    config = types.SimpleNamespace(key_file=str(path))
    assert keys.load_job_key(config, env={}) == KEY
    # With an fsGroup the kubelet would make it 0440: refused, which is why pods set none.
    path.chmod(0o440)
    with pytest.raises(keys.SecurityError, match="group or others") as refused:
        keys.load_job_key(config, env={})
    assert "fsGroup" in str(refused.value)  # the hint names the cause on Kubernetes


@pytest.mark.parametrize("slots", [1, 2])
def test_ranks_start_as_each_operator_expects(slots: int) -> None:
    spec = spec_of("plain", slots=slots, cpus=2 * slots)
    (job,) = manifests.generate(spec, "pytorchjob")
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"  # the operator finds MASTER_PORT on this container
    assert container["command"] == (
        list(spec.command) if slots == 1 else ["torchrun", "--no-python", *spec.command]
    )
    assert job["spec"]["nprocPerNode"] == str(slots)
    _runtime, trainjob = manifests.generate(spec, "trainjob")
    assert trainjob["spec"]["trainer"]["command"] == ["torchrun", "--no-python", *spec.command]
    assert trainjob["spec"]["trainer"]["numProcPerNode"] == slots
    (mpi,) = manifests.generate(spec, "mpijob")
    launcher = mpi["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    argv = launcher["command"]
    assert argv[:4] == ["mpirun", "--allow-run-as-root", "-np", str(spec.world_size)]
    assert argv[-len(spec.command) :] == list(spec.command)
    assert f"MASTER_ADDR={operators.mpijob_workers(mpi)[0]}" in argv


def test_sgx_runs_ranks_through_gramine_with_the_command_measured() -> None:
    spec = spec_of("sgx")
    (job,) = manifests.generate(spec, "pytorchjob")
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["torchrun", "--no-python", "gramine-sgx", "ringtrain"]
    text = gramine.template(spec, manifests.KEY_DIR)
    assert "loader.argv = " + str(list(spec.command)).replace("'", '"') in text


def _rank_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The variables a rank of ``docs`` gets from the manifest (container env, or mpirun -x)."""
    for d in docs:
        if d["kind"] == "MPIJob":
            argv = d["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
            pairs = [a for i, a in enumerate(argv["command"]) if argv["command"][i - 1] == "-x"]
            return dict(p.split("=", 1) for p in pairs if "=" in p)
    (container, *_) = [c for p in pods(docs) for c in p["containers"] if c["name"] != "launcher"]
    return {e["name"]: e["value"] for e in container["env"]}


@pytest.mark.parametrize("target", TARGETS)
def test_sgx_ranks_use_ringtrains_own_sockets_not_gloo(target: str) -> None:
    """Gloo cannot start in an enclave (no netlink): --sgx ranks get transport=tcp, passed into
    the enclave; other jobs keep the default (auto)."""
    sgx = _rank_env(manifests.generate(spec_of("sgx"), target, KEY))
    assert sgx["RINGTRAIN_TRANSPORT"] == "tcp"
    assert "RINGTRAIN_TRANSPORT" in gramine.passthrough_vars(spec_of("sgx"))
    for variant in ("plain", "secure"):
        env = _rank_env(manifests.generate(spec_of(variant), target, KEY))
        assert "RINGTRAIN_TRANSPORT" not in env
    with pytest.raises(ConfigError, match="cannot run in an SGX enclave"):
        spec_of("sgx", settings={"transport": "gloo"})


class _Gramine:
    libos = "/usr/lib/x86_64-linux-gnu/gramine/libsysdb.so"

    @staticmethod
    def runtimedir() -> str:
        return "/usr/lib/x86_64-linux-gnu/gramine/runtime/glibc"


class _Python:
    @staticmethod
    def get_sys_path(entrypoint: str) -> list[Path]:
        return [Path(p) for p in sys.path if p and Path(p).exists()][:3]


def _render(text: str) -> dict[str, Any]:
    """The template as gramine-manifest renders it (Jinja with its helpers), parsed as TOML."""
    jinja2 = pytest.importorskip("jinja2")
    tomllib = pytest.importorskip("tomllib")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    rendered = env.from_string(text).render(
        entrypoint="/usr/bin/python3.11",
        arch_libdir="/lib/x86_64-linux-gnu",
        gramine=_Gramine,
        python=_Python,
        env=os.environ,
    )
    return tomllib.loads(rendered)


@pytest.mark.parametrize("secure", [False, True])
def test_the_gramine_template_renders_to_a_manifest_with_what_ranks_need(secure: bool) -> None:
    spec = spec_of("sgx") if secure else JobSpec.from_mapping({**BASE, "sgx": True})
    manifest = _render(gramine.template(spec, manifests.KEY_DIR))
    plan = sizing.plan(spec)
    assert manifest["libos"]["entrypoint"] == "/usr/bin/python3.11"
    assert manifest["loader"]["argv"] == list(spec.command)
    assert manifest["sys"]["enable_extra_runtime_domain_names_conf"] is True
    sgx = manifest["sgx"]
    assert sgx["enclave_size"] == plan.enclave_size
    assert sgx["max_threads"] == plan.max_threads
    size = plan.enclave_bytes
    assert size & (size - 1) == 0, "SGX enclave sizes are powers of two"
    passed = {k for k, v in manifest["loader"]["env"].items() if v == {"passthrough": True}}
    assert {"RINGTRAIN_SECURE", "RINGTRAIN_KEY_FILE", "RINGTRAIN_NETWORK_INTERFACE"} <= passed
    assert {"MASTER_ADDR", "PET_NODE_RANK", "OMPI_COMM_WORLD_RANK", "OMP_NUM_THREADS"} <= passed
    mounts = {m["path"] for m in manifest["fs"]["mounts"]}
    assert "/app" in mounts  # the script's directory
    assert (manifests.KEY_DIR in mounts) is spec.sealed  # --sgx alone is secure too
    assert f"file:{manifests.KEY_DIR}/" in sgx["allowed_files"]
    assert "file:/app/" in sgx["trusted_files"]


def test_the_enclave_grows_with_the_model_and_the_batch() -> None:
    small = sizing.plan(spec_of("sgx", model_params=1000, batch_size=1, sample_bytes=64))
    big = sizing.plan(spec_of("sgx", model_params=300_000_000))
    assert small.enclave_bytes >= sizing.MIN_ENCLAVE_BYTES
    assert big.enclave_bytes > small.enclave_bytes
    assert big.model_bytes == 300_000_000 * sizing.MODEL_STATE_BYTES_PER_PARAM
    wide = sizing.plan(spec_of("sgx", cpus=16, slots=2))
    assert wide.omp_threads == 8 and wide.max_threads > small.max_threads


def _placement_env(target: str, spec: JobSpec) -> list[dict[str, str]]:
    """Each rank's environment as its launcher would set it, for the first pod."""
    if target == "pytorchjob":
        (job,) = manifests.generate(spec, target)
        pod = operators.pytorchjob_pods(job)[1]
        if spec.slots == 1:
            return [pod.env]
        base = pod.env
    elif target == "trainjob":
        runtime, trainjob = manifests.generate(spec, target)
        base = operators.trainjob_pods(runtime, trainjob)[1].env
    else:
        return [
            {
                "OMPI_COMM_WORLD_RANK": str(r),
                "OMPI_COMM_WORLD_SIZE": str(spec.world_size),
                "OMPI_COMM_WORLD_LOCAL_RANK": str(r % spec.slots),
                "OMPI_COMM_WORLD_LOCAL_SIZE": str(spec.slots),
                **dict(
                    a.split("=", 1)
                    for a in manifests.mpirun_command(spec)
                    if "=" in a and not a.startswith("-")
                ),
            }
            for r in range(spec.world_size)
        ]
    # torchrun's per-rank variables on that pod (node rank from PET_NODE_RANK).
    node = int(base["PET_NODE_RANK"])
    return [
        {
            **base,
            "RANK": str(node * spec.slots + local),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(spec.slots),
            "GROUP_RANK": str(node),
            "MASTER_ADDR": base.get("PET_MASTER_ADDR", ""),
            "MASTER_PORT": base.get("PET_MASTER_PORT", ""),
            "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
        for local in range(spec.slots)
    ]


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("target", TARGETS)
def test_the_enclave_lets_through_every_variable_placement_needs(target: str, slots: int) -> None:
    spec = spec_of("sgx", slots=slots, cpus=2 * slots)
    allowed = set(gramine.passthrough_vars(spec))
    for env in _placement_env(target, spec):
        inside = {k: v for k, v in env.items() if k in allowed}
        assert environment.detect(inside) == environment.detect(env)


def test_cli_writes_the_files_and_the_secret_only_for_its_owner(tmp_path: Path) -> None:
    out = tmp_path / "deploy"
    argv = ["k8s", "--name", "demo", "--image", "img:1", "--command", "python /app/t.py"]
    assert cli([*argv, "--secure", "--sgx", "--target", "mpijob", "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "kustomization.yaml",
        "mpijob.yaml",
        gramine.TEMPLATE_FILE,
        "secret.yaml",
    ]
    assert stat.S_IMODE((out / "secret.yaml").stat().st_mode) == 0o600
    assert yaml.safe_load((out / "kustomization.yaml").read_text())["resources"] == [
        "secret.yaml",
        "mpijob.yaml",
    ]
    (job,) = yaml.safe_load_all((out / "mpijob.yaml").read_text())
    assert schemas.errors(job) == []
    # A second run with --key-file keeps the key; a fresh one draws a new key.
    key_file = tmp_path / "job.key"
    keys.write_key_file(key_file, KEY)
    again = tmp_path / "again"
    assert cli([*argv, "--secure", "--key-file", str(key_file), "--out", str(again)]) == 0
    (secret,) = yaml.safe_load_all((again / "secret.yaml").read_text())
    assert base64.b64decode(secret["data"]["job.key"]) == keys.encode_key(KEY)


def test_cli_reads_a_description_file_and_flags_win(tmp_path: Path, capsys: Any) -> None:
    desc = tmp_path / "job.yaml"
    desc.write_text(yaml.safe_dump({**BASE, "settings": {"compression": "fp16"}}))
    argv = ["k8s", str(desc), "--replicas", "5", "--set", "timeout_s=60", "--shm", "6Gi"]
    assert cli(argv) == 0
    (job,) = yaml.safe_load_all(capsys.readouterr().out)
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
    volumes = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"]
    assert [v["emptyDir"]["sizeLimit"] for v in volumes if "emptyDir" in v] == ["6Gi"]
    env = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    env = {e["name"]: e["value"] for e in env}
    assert env["RINGTRAIN_COMPRESSION"] == "fp16" and env["RINGTRAIN_TIMEOUT_S"] == "60.0"
    assert env["OMP_NUM_THREADS"] == "2"


def test_cli_says_what_a_durable_mpijobs_image_needs(tmp_path: Path, capsys: Any) -> None:
    """Its worker pods run ``ringtrain pod-init``: the image must have the command."""
    desc = tmp_path / "job.yaml"
    desc.write_text(yaml.safe_dump({**BASE, "settings": {"checkpoint_dir": "/ckpt"}}))
    for target, said in (("mpijob", True), ("pytorchjob", False)):
        assert cli(["k8s", str(desc), "--target", target]) == 0
        err = capsys.readouterr().err
        assert ("the image needs the `ringtrain` command on its PATH" in err) is said, err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cpus": 3}, "not a multiple of slots"),
        ({"cpus": 1}, "fewer than slots"),
        ({"memory": "8 gigs"}, "not a Kubernetes memory quantity"),
        ({"name": "My_Job"}, "not a valid job name"),
        ({"command": "python train.py"}, "must be a list"),
        ({"replicaz": 2}, "unknown key"),
        ({"settings": {"compresion": "fp16"}}, "unknown ringtrain setting"),
        ({"settings": {"secure": True}}, "come from the description"),
        ({"env": {"RINGTRAIN_SECURE": "1"}}, "through `settings`"),
    ],
)
def test_bad_descriptions_say_what_is_wrong(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobSpec.from_mapping({**BASE, **change})


def test_cli_errors_are_one_line_not_a_traceback(tmp_path: Path, capsys: Any) -> None:
    desc = tmp_path / "job.yaml"
    desc.write_text("name: demo\nimage: img\ncommand: [python, t.py]\ncpus: 0\n")
    assert cli(["k8s", str(desc)]) == 2
    assert "ringtrain k8s: error: cpus must be a whole number >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"\xff\xfename: demo\n", "is not UTF-8 text (byte 0"),  # UTF-16, or a binary file
        (None, "cannot read"),  # a directory where the YAML file is expected
    ],
)
def test_cli_an_unreadable_description_is_one_error_and_a_hint(
    tmp_path: Path, capsys: Any, content: bytes | None, says: str
) -> None:
    desc = tmp_path / "job.yaml"
    if content is None:
        desc.mkdir()
    else:
        desc.write_bytes(content)
    assert cli(["k8s", str(desc), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"ringtrain k8s: error: {str(desc)!r} " in err or f"{str(desc)!r}:" in err, err
    assert says in err and "\nHINT: " in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_cli_a_second_run_into_the_same_out_keeps_the_key(tmp_path: Path, capsys: Any) -> None:
    """A new key would replace the one the job (and its sealed checkpoints) uses."""
    out = tmp_path / "deploy"
    argv = ["k8s", "--name", "demo", "--image", "img:1", "--command", "t", "--secure"]
    assert cli([*argv, "--out", str(out)]) == 0
    first = (out / "secret.yaml").read_bytes()
    assert cli([*argv, "--replicas", "3", "--out", str(out)]) == 0
    assert (out / "secret.yaml").read_bytes() == first
    assert "kept the job key of" in capsys.readouterr().err
    (out / "secret.yaml").write_text("not a secret\n")  # never overwritten unread
    assert cli([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds no job key ringtrain can read" in err and "\nHINT: move it away" in err
    assert (out / "secret.yaml").read_text() == "not a secret\n"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed here")
def test_kubectl_kustomize_renders_the_output_offline(tmp_path: Path) -> None:
    """kubectl (where installed: CI's fresh machine may lack it) builds the directory as
    ``kubectl apply -k`` would, without an API server."""
    docs = manifests.generate(spec_of("secure"), "pytorchjob", KEY)
    (tmp_path / "secret.yaml").write_text(to_yaml(docs[:1]))
    (tmp_path / "job.yaml").write_text(to_yaml(docs[1:]))
    (tmp_path / "kustomization.yaml").write_text(
        kustomization(["secret.yaml", "job.yaml"], "default")
    )
    built = subprocess.run(
        ["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    rendered = {d["kind"]: d for d in yaml.safe_load_all(built.stdout)}
    assert rendered["PyTorchJob"] == yaml.safe_load(to_yaml(docs[1:]))
    assert rendered["Secret"]["data"] == docs[0]["data"]


def test_cli_refuses_a_key_file_others_can_read(tmp_path: Path, capsys: Any) -> None:
    key_file = tmp_path / "job.key"
    keys.write_key_file(key_file, KEY)
    key_file.chmod(0o644)
    argv = ["k8s", "--name", "demo", "--image", "img", "--command", "python t.py", "--secure"]
    assert cli([*argv, "--key-file", str(key_file), "--out", str(tmp_path / "o")]) == 2
    assert "group or others" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("description", [None, {"secure": False}])
@pytest.mark.timeout(90)
def test_cli_refuses_a_key_file_for_a_job_that_is_not_secure(
    tmp_path: Path, description: dict[str, Any] | None
) -> None:
    """The key would go unused and the traffic unsealed: refused, not ignored in silence."""
    key_file = tmp_path / "job.key"
    keys.write_key_file(key_file, KEY)
    argv = ["k8s", "--name", "demo", "--image", "img", "--command", "python t.py"]
    if description is not None:
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(description))
        argv.append(str(tmp_path / "job.yaml"))
    out = tmp_path / "o"
    done = subprocess.run(
        [sys.executable, "-m", "ringtrain", *argv, "--key-file", str(key_file), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("ringtrain k8s: error:")]
    assert f"--key-file {str(key_file)!r} is given, but the job is not secure" in line
    assert "\nHINT: add --secure" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == "" and not out.exists()


@pytest.mark.timeout(90)
def test_cli_refuses_a_key_file_with_no_secret(tmp_path: Path) -> None:
    """With --no-secret the pods read a Secret made by hand: a key file would go unused."""
    key_file = tmp_path / "job.key"
    keys.write_key_file(key_file, KEY)
    out = tmp_path / "o"
    argv = ["k8s", "--name", "demo", "--image", "img", "--command", "python t.py", "--secure"]
    done = subprocess.run(
        [sys.executable, "-m", "ringtrain", *argv, "--no-secret", "--key-file", str(key_file),
         "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("ringtrain k8s: error:")]
    assert f"--key-file {str(key_file)!r} and --no-secret are both given" in line
    assert "\nHINT: leave --no-secret out" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == "" and not out.exists()


def test_cli_names_an_unknown_setting(capsys: Any) -> None:
    argv = ["k8s", "--name", "demo", "--image", "img", "--command", "python t.py"]
    assert cli([*argv, "--set", "compresion=fp16"]) == 2
    assert "--set compresion: unknown ringtrain setting" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"port": "23456"}, "port must be >= 1 and <= 65535 (a whole number), got '23456'"),
        ({"port": 2.5}, "port must be >= 1 and <= 65535 (a whole number), got 2.5"),
        ({"settings": {"timeout_s": "30s"}}, "settings: timeout_s='30s' is not a valid float"),
        ({"settings": {"timeout_s": float("nan")}}, "timeout_s must be > 0"),
        ({"settings": {"fusion_threshold_bytes": -1}}, "fusion_threshold_bytes must be >= 0"),
        # ringtrain run's own rule for a launcher's --compression (docs/deploy.md promises it)
        ({"settings": {"compression": "zstd"}}, "settings: compression 'zstd' is not one of"),
    ],
)
@pytest.mark.timeout(60)
def test_cli_refuses_bad_values_in_one_line_and_writes_nothing(
    tmp_path: Path, capsys: Any, change: dict[str, Any], says: str
) -> None:
    desc = tmp_path / "job.yaml"
    desc.write_text(yaml.safe_dump({**BASE, **change}))
    assert cli(["k8s", str(desc), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("ringtrain k8s: error:")]
    assert says in line, err
    assert "HINT:" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_settings_meet_the_rules_of_ringtrain_run(capsys: Any) -> None:
    """--set and the file's settings: one rule book (ringtrain.config), text read as the
    RINGTRAIN_* twin would read it."""
    argv = ["k8s", "--name", "demo", "--image", "img", "--command", "python t.py"]
    assert cli([*argv, "--set", "compression=zstd"]) == 2
    assert "compression 'zstd' is not one of ringtrain's compressions" in capsys.readouterr().err
    assert cli([*argv, "--set", "cycle_time_ms=inf"]) == 2
    assert "--set cycle_time_ms=inf: cycle_time_ms must be > 0" in capsys.readouterr().err
    spec = JobSpec.from_mapping(
        {**BASE, "settings": {"timeout_s": "30", "overlap": "yes", "checkpoint_every": 100}}
    )
    assert dict(spec.settings) == {"timeout_s": 30.0, "overlap": True, "checkpoint_every": "100"}


@pytest.mark.timeout(60)
def test_an_unbalanced_quote_in_the_command_is_one_error(capsys: Any) -> None:
    argv = ["k8s", "--name", "demo", "--image", "img", "--command", "python 't.py"]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert '--command "python \'t.py": No closing quotation' in err, err
    assert "HINT:" in err and "Traceback" not in err


@pytest.mark.timeout(60)
def test_cli_out_under_a_regular_file_is_one_error(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "plain").write_text("")
    out = tmp_path / "plain" / "deploy"
    argv = ["k8s", "--name", "demo", "--image", "img", "--command", "python t.py"]
    assert cli([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"ringtrain k8s: error: --out {str(out)!r}: {tmp_path / 'plain'} is a file" in err
    assert "HINT:" in err and "Traceback" not in err


def test_numbers_in_the_command_are_refused_not_rewritten() -> None:
    """YAML reads --seed 010 as 8: str() of it would run another command than written."""
    with pytest.raises(ConfigError, match=r"command\[3\] \(after '--epochs'\) is the number 10"):
        JobSpec.from_mapping({**BASE, "command": ["python", "t.py", "--epochs", 10]})
    spec = JobSpec.from_mapping({**BASE, "command": ["python", "t.py", "--epochs", "010"]})
    assert spec.command == ("python", "t.py", "--epochs", "010")


def test_without_pyyaml_the_command_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now raises ImportError
    argv = ["k8s", "--name", "demo", "--image", "img", "--command", "python t.py"]
    assert cli(argv) == 2
    assert "pip install 'ringtrain[k8s]'" in capsys.readouterr().err


def test_the_command_never_imports_torch(tmp_path: Path) -> None:
    """Manifests are written where torch may not be installed (a laptop, a CI job)."""
    code = (
        "import sys; from ringtrain.cli import main; "
        f"rc = main(['k8s', '--name', 'a', '--image', 'i', '--command', 'python t.py', "
        f"'--sgx', '--out', {str(tmp_path)!r}]); "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'torch imported'; "
        "sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("target", TARGETS)
def test_a_durable_jobs_pods_leave_its_ranks_the_grace_period(target: str) -> None:
    """docs/deploy.md, "Preemption": where the ranks save (``checkpoint_dir`` in settings), the
    rank pods' terminationGracePeriodSeconds is the grace period (rounded up) and 10 s; the
    MPIJob's pods' twice the grace period and 10 s, its mpirun passes the SIGTERM on after the
    grace period (``odls_base_sigkill_timeout``), and its workers' sshd runs under ``ringtrain
    pod-init``, which passes their pod's SIGTERM on to the ranks. Elsewhere, none of it."""
    for variant, want in (("durable", 45), ("plain", None)):
        spec = spec_of(variant)
        docs = manifests.generate(spec, target, KEY)
        graces = [p.get("terminationGracePeriodSeconds") for p in pods(docs)]
        mca = " --mca odls_base_sigkill_timeout 45 " in " ".join(manifests.mpirun_command(spec))
        slack = manifests.EXIT_SLACK_S
        inits = [
            c["command"][:3] == manifests.POD_INIT for p in pods(docs) for c in p["containers"]
        ]
        if want is None:
            assert set(graces) == {None} and not mca and not any(inits)
        elif target == "mpijob":  # the launcher's pod, then the workers' (sshd's)
            assert graces == [2 * want + slack] * 2 and mca and inits == [False, True]
        else:
            assert set(graces) == {want + slack} and not any(inits)
