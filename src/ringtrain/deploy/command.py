"""``ringtrain k8s``: a description (YAML file and/or flags) -> Kubernetes manifests.

    ringtrain k8s --name mnist --image reg/mnist:1 --command "python /app/train.py" \\
        --replicas 4 --slots 2 --cpus 8 --memory 16Gi --secure --out deploy/
    ringtrain k8s job.yaml --target mpijob --out deploy/      # keys as in JobSpec
    kubectl apply -k deploy/

Flags override the file's keys. With ``--out DIR`` it writes ``<target>.yaml``, the key's
``secret.yaml`` (mode 600: it holds the job key), ``ringtrain.manifest.template`` for ``--sgx``,
and a ``kustomization.yaml``; without it, the manifests go to standard output.
"""

from __future__ import annotations

import argparse
import base64
import os
import shlex
import sys
import types
from pathlib import Path
from typing import Any

from ringtrain.config import check_path, settings_from
from ringtrain.deploy import gramine, manifests, render, sizing
from ringtrain.deploy.spec import TARGETS, JobSpec
from ringtrain.errors import ConfigError

# flag -> (JobSpec key, type, help)
_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--name", "name", str, "job name (prefix of every pod's name)"),
    ("--namespace", "namespace", str, "Kubernetes namespace (default: default)"),
    ("--image", "image", str, "container image with ringtrain and the training script"),
    ("--replicas", "replicas", int, "pods that run ranks (default: 2)"),
    ("--slots", "slots", int, "ranks per pod (default: 1)"),
    ("--cpus", "cpus", int, "whole CPUs per pod, exclusive under the static CPU manager"),
    ("--memory", "memory", str, "memory per pod, e.g. 16Gi (default: 2Gi)"),
    ("--shm", "shm", str, "each rank pod's /dev/shm, e.g. 4Gi (default: half of --memory)"),
    ("--interface", "interface", str, "the pods' network interface (default: eth0)"),
    ("--port", "port", int, "rendezvous port on rank 0's pod (default: 23456)"),
    ("--model-params", "model_params", int, "--sgx: the model's parameter count"),
    ("--batch-size", "batch_size", int, "--sgx: samples per rank and step"),
    ("--sample-bytes", "sample_bytes", int, "--sgx: bytes of one input sample"),
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("description", nargs="?", help="YAML file with the job's keys (optional)")
    p.add_argument("--target", choices=TARGETS, default="pytorchjob", help="what to generate")
    p.add_argument("--command", help='the training command, e.g. "python /app/train.py"')
    for flag, _key, kind, text in _FLAGS:
        p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument("--secure", action="store_true", default=None, help="seal all traffic")
    p.add_argument(
        "--sgx", action="store_true", default=None, help="run every rank in an SGX enclave"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a ringtrain setting for every rank (a Config field), e.g. --set compression=fp16",
    )
    p.add_argument("--env", action="append", default=[], metavar="VAR=VALUE")
    p.add_argument("--key-file", help="put this existing job key in the Secret (default: new)")
    p.add_argument("--no-secret", action="store_true", help="write no Secret (make it yourself)")
    p.add_argument("--out", help="directory to write into (default: standard output)")


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"{flag} {item!r}: expected NAME=VALUE")
        out[name.strip()] = value
    return out


def description(args: argparse.Namespace) -> dict[str, Any]:
    """The description's keys: the file's, then the flags given on top."""
    data: dict[str, Any] = {}
    if args.description:
        try:
            text = Path(args.description).read_text()
        except OSError as e:
            raise ConfigError(
                f"cannot read {args.description!r}: {e.strerror}.\n"
                "HINT: give a readable YAML file with the job's keys, or only flags."
            ) from None
        except UnicodeDecodeError as e:  # e.g. saved as UTF-16, or a binary file given
            raise ConfigError(
                f"{args.description!r} is not UTF-8 text (byte {e.start}: {e.reason}).\n"
                "HINT: save the description as plain UTF-8 YAML (name: ..., image: ...)."
            ) from None
        yaml = render._yaml()
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{args.description} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{args.description} must hold a mapping of keys (name: ..., ...)")
        data.update(loaded)
    for _flag, key, _kind, _help in _FLAGS:
        value = getattr(args, key)
        if value is not None:
            data[key] = value
    if args.command is not None:
        try:
            data["command"] = shlex.split(args.command)
        except ValueError as e:  # an unbalanced quote
            raise ConfigError(
                f"--command {args.command!r}: {e}.\nHINT: quote it as a shell would, e.g. "
                '--command "python train.py --epochs 3".'
            ) from None
    for key in ("secure", "sgx"):
        if getattr(args, key):
            data[key] = True
    settings = _pairs(args.set, "--set")
    if settings:
        data["settings"] = {**dict(data.get("settings") or {}), **_typed(settings)}
    env = _pairs(args.env, "--env")
    if env:
        data["env"] = {**dict(data.get("env") or {}), **env}
    return data


def _typed(settings: dict[str, str]) -> dict[str, Any]:
    """``--set`` values parsed as their Config field's type (as its RINGTRAIN_* twin)."""
    return settings_from(settings, "--set")


def _key(args: argparse.Namespace, spec: JobSpec) -> bytes | None:
    if args.key_file and not spec.sealed:
        # Not silently dropped: whoever gives a key believes the job is sealed.
        raise ConfigError(
            f"--key-file {args.key_file!r} is given, but the job is not secure: its traffic "
            "would not be sealed and the key would go unused.\n"
            "HINT: add --secure (or secure: true in the description) to seal the job with this "
            "key, or leave --key-file out."
        )
    if args.key_file and args.no_secret:
        # The key would go nowhere: with --no-secret the pods read a Secret made by hand.
        raise ConfigError(
            f"--key-file {args.key_file!r} and --no-secret are both given: no Secret is "
            "written, so the key would go unused and the pods would read whatever Secret you "
            "made yourself.\n"
            "HINT: leave --no-secret out to put this key in the Secret, or leave --key-file "
            "out and make the Secret yourself (docs/deploy.md)."
        )
    if not spec.sealed or args.no_secret:
        return None
    from ringtrain.security import keys

    if args.key_file:
        return keys.load_job_key(types.SimpleNamespace(key_file=args.key_file), env={})
    return _kept_key(args.out) or keys.generate_job_key()


def _kept_key(out: str | None) -> bytes | None:
    """The key in an earlier run's ``OUT/secret.yaml``, kept: a new one would replace it there
    (and, applied, in the cluster), and what the job sealed with it (its checkpoints) could no
    longer be opened."""
    path = Path(out or "") / "secret.yaml"
    if not out or not path.is_file():
        return None
    from ringtrain.security import keys

    try:
        (doc,) = render._yaml().safe_load_all(path.read_text())
        key = keys.decode_key(base64.b64decode(doc["data"][manifests.KEY_ITEM]), str(path))
    except Exception:  # any damage: the file is the user's, never overwritten unread
        raise ConfigError(
            f"--out {out!r}: {path} exists but holds no job key ringtrain can read, and this "
            "run would replace it.\nHINT: move it away to draw a new key, or give the key "
            "with --key-file."
        ) from None
    print(
        f"ringtrain k8s: kept the job key of {path} (move it away for a new key)", file=sys.stderr
    )
    return key


def main(args: argparse.Namespace) -> int:
    spec = JobSpec.from_mapping(description(args), where=args.description or "the flags")
    key = _key(args, spec)
    docs = manifests.generate(spec, args.target, key)
    secret = [d for d in docs if d["kind"] == "Secret"]
    jobs = [d for d in docs if d["kind"] != "Secret"]
    if spec.sgx:
        for line in sizing.plan(spec).lines():
            print(f"ringtrain k8s: enclave {line}", file=sys.stderr)
    if args.target == "mpijob" and spec.stop_grace_s is not None:
        print(
            "ringtrain k8s: the worker pods run sshd under `ringtrain pod-init`, which passes a "
            "preemption's SIGTERM on to their ranks: the image needs the `ringtrain` command on "
            "its PATH",
            file=sys.stderr,
        )
    if not args.out:
        sys.stdout.write(render.to_yaml(docs))
        if spec.sgx:
            print(
                "ringtrain k8s: --sgx also needs the Gramine manifest template: use --out DIR",
                file=sys.stderr,
            )
        return 0
    out = Path(args.out)
    check_path(f"--out {args.out!r}", args.out, directory=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # what check_path cannot foresee (a read-only file system, ...)
        raise ConfigError(
            f"--out {args.out!r}: cannot create {e.filename or out}: {e.strerror}.\n"
            "HINT: give a directory you can write to."
        ) from None
    files = []
    if secret:
        _write(out / "secret.yaml", render.to_yaml(secret), 0o600)
        files.append("secret.yaml")
    _write(out / f"{args.target}.yaml", render.to_yaml(jobs), 0o644)
    files.append(f"{args.target}.yaml")
    _write(out / "kustomization.yaml", render.kustomization(files, spec.namespace), 0o644)
    written = [*files, "kustomization.yaml"]
    if spec.sgx:
        template = gramine.template(spec, manifests.KEY_DIR)
        _write(out / gramine.TEMPLATE_FILE, template, 0o644)
        written.append(gramine.TEMPLATE_FILE)
    print(f"ringtrain k8s: wrote {', '.join(written)} to {out}", file=sys.stderr)
    if spec.sealed and not secret:
        print(
            f"ringtrain k8s: create the key's Secret yourself: kubectl create secret generic "
            f"{manifests.secret_name(spec)} -n {spec.namespace} "
            f"--from-file={manifests.KEY_ITEM}=./job.key",
            file=sys.stderr,
        )
    return 0


def _write(path: Path, text: str, mode: int) -> None:
    # Created with its final mode: the Secret's file is never readable by others, even briefly.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.fchmod(fd, mode)
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as e:
        raise ConfigError(
            f"--out: cannot write {path}: {e.strerror}.\n"
            "HINT: give a directory you can write to, with no directory named like the files."
        ) from None
