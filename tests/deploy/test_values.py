"""Values reach the cluster as written: YAML scalars are never turned back into other text, the
Gramine template renders the command exactly, and Kubernetes' own grammar decides what a memory
quantity and a namespace may be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ringtrain.cli import main as cli
from ringtrain.deploy import gramine, manifests
from ringtrain.deploy.render import to_yaml
from ringtrain.deploy.spec import JobSpec, memory_bytes
from ringtrain.errors import ConfigError

from . import schemas
from .test_manifests import BASE, _render

HEAD = "name: demo\nimage: img\n"


@pytest.mark.parametrize(
    ("yaml_text", "says"),
    [
        # YAML 1.1 reads 010 as octal, 0x1A as hexadecimal, 1.0e-3 as a float.
        ("command: [python, t.py, --seed, 010]", "command[3] (after '--seed') is the number 8,"),
        ("command: [python, t.py, --lr, 1.0e-3]", "command[3] (after '--lr') is the number 0.001"),
        ("command: [python, t.py, --tag, 0x1A]", "command[3] (after '--tag') is the number 26,"),
        ("command: [python, t.py, 2024-01-02]", "command[2] (after 't.py') is the date"),
        ("command: [python, t.py, ~]", "command[2] (after 't.py') is null"),
        ("command: [python, t.py]\nenv: {A: null}", "env: A is null (no value), not a string"),
        ("command: [python, t.py]\nenv: {B: true}", "env: B is the boolean true, not a string"),
        ("command: [python, t.py]\nenv: {C: 1.50}", "env: C is the number 1.5, not a string"),
        ("command: [python, t.py]\nenv: {D: 012}", "env: D is the number 10, not a string"),
        ("command: [python, t.py]\nenv: {E: off}", "env: E is the boolean false, not a string"),
        ("command: [python, t.py]\nenv: {on: x}", "env: a name is the boolean true, not a string"),
    ],
)
def test_yaml_values_that_are_not_strings_are_refused_in_one_line(
    tmp_path: Path, capsys: Any, yaml_text: str, says: str
) -> None:
    desc = tmp_path / "job.yaml"
    desc.write_text(HEAD + yaml_text + "\n")
    assert cli(["k8s", str(desc), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("ringtrain k8s: error:")]
    assert f"{desc}: {says}" in line, err
    assert "\nHINT: write it in quotes" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_quoted_yaml_values_reach_the_pods_as_written() -> None:
    text = (
        HEAD + 'command: [python, t.py, --seed, "010", --lr, "1.0e-3", --tag, "0x1A"]\n'
        'env: {A: "", B: "true", C: "1.50", D: "012", E: "off"}\n'
    )
    spec = JobSpec.from_mapping(yaml.safe_load(text))
    argv = ["python", "t.py", "--seed", "010", "--lr", "1.0e-3", "--tag", "0x1A"]
    assert list(spec.command) == argv
    # What kubectl would send: the YAML text, read back.
    (job,) = yaml.safe_load_all(to_yaml(manifests.generate(spec, "pytorchjob")))
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    written = {"A": "", "B": "true", "C": "1.50", "D": "012", "E": "off"}
    assert {k: env[k] for k in written} == written
    assert container["command"][-len(argv) :] == argv


JINJA_ARGS = [
    "{{ 7*6 }}",
    "run{#1#}x",
    "{% if x %}",
    "{% endraw %}{% raw %}",
    "{%- raw -%}",
    "{{ '}}' }}",
    "}}{{",
    "{",
    'a"b\\c{{',
    "é😀{",  # past U+FFFF: JSON would write a surrogate pair, which TOML refuses
    "\x7f\t\n{",  # DEL: TOML wants it escaped, JSON does not
]


def test_the_gramine_template_measures_the_command_exactly_as_given() -> None:
    """gramine-manifest renders the template with Jinja: the command's text must not be Jinja."""
    command = ["python", "/app{{ x }}/t.py", "--j", *JINJA_ARGS, "--plain", "10"]
    spec = JobSpec.from_mapping({**BASE, "command": command, "sgx": True})
    manifest = _render(gramine.template(spec, manifests.KEY_DIR))
    assert manifest["loader"]["argv"] == command
    assert "/app{{ x }}" in {m["path"] for m in manifest["fs"]["mounts"]}
    assert "file:/app{{ x }}/" in manifest["sgx"]["trusted_files"]
    # Text with no brace is written as before: a plain TOML string.
    assert '"--plain", "10"' in gramine.template(spec, manifests.KEY_DIR)


@pytest.mark.parametrize(
    ("quantity", "size"),
    [
        ("2Gi", 2 << 30),
        ("1.5Gi", 3 << 29),
        ("500M", 500 * 10**6),
        ("1e3", 1000),
        ("1E9", 10**9),
        ("+1Gi", 1 << 30),
        (".5Ki", 512),
        ("2.Gi", 2 << 30),
        ("1Ei", 1 << 60),
        ("0.5k", 500),
        ("4096", 4096),
    ],
)
def test_decimal_and_exponent_memory_quantities_are_kubernetes_quantities(
    quantity: str, size: int
) -> None:
    assert memory_bytes(quantity) == size
    (job,) = manifests.generate(JobSpec.from_mapping({**BASE, "memory": quantity}), "pytorchjob")
    assert schemas.errors(yaml.safe_load(yaml.safe_dump(job))) == []
    resources = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert resources["resources"]["limits"]["memory"] == quantity


@pytest.mark.parametrize(
    ("quantity", "says"),
    [
        ("8 gigs", "not a Kubernetes memory quantity"),
        ("1.5Gb", "not a Kubernetes memory quantity"),
        ("1e1.5", "not a Kubernetes memory quantity"),
        ("Gi", "not a Kubernetes memory quantity"),
        ("0", "not more than 0 bytes"),
        ("-1Gi", "not more than 0 bytes"),
        ("1500m", "is 1.5 bytes, not a whole number of bytes ('m' is milli"),
    ],
)
def test_memory_that_is_no_quantity_or_no_whole_bytes_is_refused(quantity: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"\nHINT: ") as raised:
        JobSpec.from_mapping({**BASE, "memory": quantity})
    assert says in str(raised.value)


@pytest.mark.parametrize(
    ("shm", "says"),
    [
        ("4 gigs", "shm '4 gigs' is not a Kubernetes memory quantity"),
        ("0", "shm '0' is not more than 0 bytes"),
        ("3Gi", "shm '3Gi' is more than the pod's memory '2Gi': /dev/shm's pages count"),
        (4, "shm must be a string, got 4"),
    ],
)
def test_a_dev_shm_that_is_no_quantity_or_more_than_the_pods_memory_is_refused(
    shm: object, says: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        JobSpec.from_mapping({**BASE, "memory": "2Gi", "shm": shm})
    assert says in str(raised.value)
    if "more than the pod's memory" in says:
        assert "HINT: shm: 1Gi (the default, half of memory), or raise memory." in str(raised.value)


@pytest.mark.parametrize("namespace", ["1team", "123", "a", "ml-team-2", "x" * 63])
def test_namespaces_are_rfc_1123_labels(namespace: str) -> None:
    spec = JobSpec.from_mapping({**BASE, "namespace": namespace})
    for doc in manifests.generate(spec, "pytorchjob", bytes(32)):
        assert doc["metadata"]["namespace"] == namespace


@pytest.mark.parametrize("namespace", ["team-", "-team", "Team", "ml_team", "x" * 64, ""])
def test_namespaces_that_are_no_label_are_refused(namespace: str) -> None:
    with pytest.raises(ConfigError, match="not a valid Kubernetes namespace: lowercase"):
        JobSpec.from_mapping({**BASE, "namespace": namespace})


def test_job_names_stay_dns_1035_labels() -> None:
    """The TrainJob CRD's rule (and Service names): a job name starts with a letter."""
    with pytest.raises(ConfigError, match="not a valid job name"):
        JobSpec.from_mapping({**BASE, "name": "1job"})
