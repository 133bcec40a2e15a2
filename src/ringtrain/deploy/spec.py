"""The one description a deployment is generated from: :class:`JobSpec`.

It is what a user knows about a job (image, command, how many pods, ranks and CPUs per pod,
memory, secure or not, the network interface, and for ``--sgx`` the model and batch sizes), read
from CLI flags and/or a small YAML mapping with the same keys. Every key is checked here, once,
so the generators (:mod:`ringtrain.deploy.manifests`) only build dictionaries.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any

from ringtrain.config import Bounds, Config, check_launch_settings, settings_from, to_env
from ringtrain.environ import PREFIX, Threads
from ringtrain.errors import ConfigError
from ringtrain.launch.tuning import HostFacts, tune

TARGETS = ("pytorchjob", "mpijob", "trainjob")
# Kubernetes names: DNS-1035 labels. Pod names add "-worker-12", Services "-worker", Secrets
# "-ringtrain-key", so a job name keeps 40 of the 63 characters a label may have.
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 40
# Namespaces: RFC 1123 labels (they may start with a digit), at most 63 characters.
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Kubernetes quantities (k8s.io/apimachinery resource.Quantity): a signed decimal number
# (`1`, `1.5`, `.5`, `2.`), then a binary suffix (Ki..Ei), a decimal one (n, u, m, k, M..E) or
# a decimal exponent (`e3`, `E-2`).
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<suffix>[KMGTPE]i|[numkMGTPE])|[eE](?P<exponent>[+-]?[0-9]+))?$"
)
_SUFFIX_FACTOR = {
    **{f"{p}i": Fraction(1 << (10 * (i + 1))) for i, p in enumerate("KMGTPE")},
    **{p: Fraction(10) ** (3 * i) for i, p in enumerate("kMGTPE", start=1)},
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PORT = Bounds(1, high=65535, whole=True, hint="a TCP port, as a number: port: 23456.")


@dataclass(frozen=True)
class JobSpec:
    """What to deploy. Build with :meth:`from_mapping` (checks every key and value)."""

    # The job's name: the PyTorchJob/MPIJob/TrainJob name and the prefix of its pods.
    name: str
    # The container image every pod runs (ringtrain and the training script inside).
    image: str
    # The training command, as an argv list: ["python", "/app/train.py", "--epochs", "3"].
    command: tuple[str, ...]
    namespace: str = "default"
    # Pods (hosts) that run ranks; each gets `slots` ranks.
    replicas: int = 2
    # Ranks per pod (torchrun starts them in PyTorchJob/TrainJob pods, mpirun in MPIJob's).
    slots: int = 1
    # Whole CPUs per pod: requests == limits, so the static CPU manager gives exclusive cores.
    cpus: int = 1
    # Memory per pod (a Kubernetes quantity); requests == limits (Guaranteed QoS).
    memory: str = "2Gi"
    # The size of each rank pod's /dev/shm, a memory-backed emptyDir (its pages count against
    # `memory`); "" is half of `memory`: room for a copy of the rank's state beside the state.
    shm: str = ""
    # Seal all traffic with the job key from a Secret (see docs/security.md).
    secure: bool = False
    # The pods' network interface for ringtrain's traffic (RINGTRAIN_NETWORK_INTERFACE).
    interface: str = "eth0"
    # The rendezvous port on rank 0's pod (MASTER_PORT) of PyTorchJob and MPIJob (TrainJob's is
    # the operator's). 23456 is the PyTorchJob default.
    port: int = 23456
    # Run every rank inside an SGX enclave with Gramine (implies secure, and transport "tcp").
    sgx: bool = False
    # For the enclave size estimate (--sgx): the model's parameter count, the samples per rank
    # and step, and the bytes of one sample as the model reads it (e.g. 3*224*224*4).
    model_params: int = 0
    batch_size: int = 0
    sample_bytes: int = 0
    # Extra ringtrain settings (Config fields), passed to every rank as RINGTRAIN_* variables.
    settings: Mapping[str, Any] = field(default_factory=dict)
    # Extra environment variables for every rank.
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (_NAME.match(self.name) and len(self.name) <= MAX_NAME):
            raise ConfigError(
                f"name {self.name!r} is not a valid job name: lowercase letters, digits and '-', "
                f"starting with a letter, at most {MAX_NAME} characters.\nHINT: e.g. mnist-ddp."
            )
        if not _NAMESPACE.match(self.namespace) or len(self.namespace) > 63:
            raise ConfigError(
                f"namespace {self.namespace!r} is not a valid Kubernetes namespace: lowercase "
                "letters, digits and '-', starting and ending with a letter or digit, at most 63 "
                "characters.\nHINT: e.g. ml-team."
            )
        if not self.image.strip() or any(c.isspace() for c in self.image):
            raise ConfigError(f"image {self.image!r} must be one image reference, no spaces")
        if not self.command or not all(isinstance(a, str) and a for a in self.command):
            raise ConfigError(
                "command must be a non-empty list of non-empty strings.\n"
                'HINT: command: ["python", "/app/train.py"] (YAML) or --command "python train.py".'
            )
        for key in ("replicas", "slots", "cpus"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key} must be a whole number >= 1, got {value!r}")
        if self.cpus < self.slots:
            raise ConfigError(
                f"cpus={self.cpus} is fewer than slots={self.slots}: every rank needs a core of "
                "its own.\nHINT: raise cpus to a multiple of slots, or lower slots."
            )
        if self.cpus % self.slots:
            raise ConfigError(
                f"cpus={self.cpus} is not a multiple of slots={self.slots}: ranks of one pod "
                f"would get unequal cores.\nHINT: cpus={self.slots * (self.cpus // self.slots)} "
                f"or {self.slots * (self.cpus // self.slots + 1)}."
            )
        memory = memory_bytes(self.memory)
        if self.shm and memory_bytes(self.shm, "shm") > memory:
            raise ConfigError(
                f"shm {self.shm!r} is more than the pod's memory {self.memory!r}: /dev/shm's "
                "pages count against the pod's memory limit, so no more than that can be used."
                f"\nHINT: shm: {_quantity(memory // 2)} (the default, half of memory), or "
                "raise memory."
            )
        object.__setattr__(self, "port", _PORT.check("port", self.port))
        if not self.interface or any(c.isspace() or c == "/" for c in self.interface):
            raise ConfigError(f"interface {self.interface!r} is not an interface name")
        for key in ("model_params", "batch_size", "sample_bytes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{key} must be a whole number >= 0, got {value!r}")
        for name in self.env:
            if not _ENV_NAME.match(name):
                raise ConfigError(f"env: {name!r} is not a valid environment variable name")
            if name.startswith(PREFIX):
                raise ConfigError(
                    f"env: set {name} through `settings` (the Config field), so it is checked."
                )
        # Unknown settings and bad values fail here, as they would on every rank, by the rules
        # `ringtrain run` applies to its flags (a compression must be ringtrain's, ...).
        settings = settings_from(self.settings, "settings:")
        given = {name: f"settings: {name}" for name in settings}
        check_launch_settings(Config.from_env({}, **settings), given)
        object.__setattr__(self, "settings", settings)
        reserved = {"secure", "key_file", "network_interface"} & set(self.settings)
        if reserved:
            raise ConfigError(
                f"settings: {', '.join(sorted(reserved))} come from the description's own keys "
                "(secure, interface); remove them from settings."
            )
        if self.sgx and self.settings.get("transport") == "gloo":
            raise ConfigError(
                "settings: transport 'gloo' cannot run in an SGX enclave: Gloo needs netlink, "
                "which Gramine lacks.\nHINT: remove transport from settings (sgx jobs use 'tcp')."
            )

    @property
    def sealed(self) -> bool:
        """Whether ranks run in secure mode (an enclave job always does)."""
        return self.secure or self.sgx

    @property
    def shm_size(self) -> str:
        """The size of each rank pod's ``/dev/shm`` (a Kubernetes quantity)."""
        return self.shm or _quantity(memory_bytes(self.memory) // 2)

    @property
    def stop_grace_s(self) -> int | None:
        """Where the ranks save on a preemption (a checkpoint directory, or a resume, in
        ``settings``): the seconds they have to stop at a step and save it (``grace_period_s``,
        rounded up, at least 1). None where they do not save."""
        if not (self.settings.get("checkpoint_dir") or self.settings.get("resume")):
            return None
        return max(1, math.ceil(self.settings.get("grace_period_s", Config().grace_period_s)))

    @property
    def world_size(self) -> int:
        return self.replicas * self.slots

    @property
    def threads_per_rank(self) -> int:
        """OMP_NUM_THREADS of every rank: ``ringtrain run``'s thread plan for a host with the
        pod's cores and ``slots`` ranks (each rank its share of the cores)."""
        # A Guaranteed pod: a cpuset of `cpus` cores and a CFS quota of as many CPUs.
        facts = HostFacts(self.name, tuple(range(self.cpus)), cpu_quota=float(self.cpus))
        plan = tune(facts, self.slots, bind_to="auto", malloc="system", user_env={})
        return int(plan[0].env[Threads.OMP_NUM_THREADS])

    def ringtrain_env(self, key_file: str) -> dict[str, str]:
        """The RINGTRAIN_* variables every rank gets (settings, secure mode, interface)."""
        settings = dict(self.settings)
        settings["network_interface"] = self.interface
        if self.sealed:
            settings.update(secure=True, key_file=key_file)
        if self.sgx:
            # Gloo cannot start in an enclave (no netlink); ringtrain's own sockets can, and
            # saying so spares each rank its netlink probe.
            settings.setdefault("transport", "tcp")
        return to_env(**settings)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "the description") -> JobSpec:
        """A JobSpec from a mapping (a parsed YAML file, or flags): unknown keys are errors."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be a mapping of keys to values, got {type(data)}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(map(str, unknown))}.\n"
                f"HINT: known keys are {', '.join(known)}."
            )
        missing = [n for n in ("name", "image", "command") if data.get(n) in (None, "", [])]
        if missing:
            raise ConfigError(f"{where}: {', '.join(missing)} must be given")
        values = dict(data)
        command = values["command"]
        if isinstance(command, str):
            raise ConfigError(
                f"{where}: command must be a list of arguments, got the string {command!r}.\n"
                f'HINT: command: {command.split()!r} (YAML) or --command "{command}" (CLI).'
            )
        if not isinstance(command, list | tuple):
            raise ConfigError(f"{where}: command must be a list of arguments, got {command!r}")
        values["command"] = tuple(_argv(command, where))
        for key in ("settings", "env"):
            if key in values and not isinstance(values[key], Mapping):
                raise ConfigError(f"{where}: {key} must be a mapping, got {values[key]!r}")
        values["env"] = _env(dict(values.get("env") or {}), where)
        values["settings"] = dict(values.get("settings") or {})
        for key in ("secure", "sgx"):
            if key in values and not isinstance(values[key], bool):
                raise ConfigError(f"{where}: {key} must be true or false, got {values[key]!r}")
        for key in ("name", "image", "namespace", "interface", "memory", "shm"):
            if key in values and not isinstance(values[key], str):
                raise ConfigError(f"{where}: {key} must be a string, got {values[key]!r}")
        return cls(**values)

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)


# YAML reads unquoted 012 as 10, 0x1A as 26, 1.50 as 1.5, off as false and 2024-01-02 as a
# date: turned back into text they would not be what was written, so they are refused.
_QUOTE_HINT = (
    "HINT: write it in quotes, as the job should see it: {example} (unquoted, YAML reads 012 as "
    "the number 10, 0x1A as 26, 1.0e-3 as 0.001 and off as false)."
)


def _as_yaml_read(value: object) -> str:
    """``value`` named as YAML read it: ``the number 8``, ``the boolean false``, ``null``."""
    if value is None:
        return "null (no value)"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    return f"the {type(value).__name__} {value!r}"


def _argv(command: Sequence[object], where: str) -> list[str]:
    """``command``'s arguments, each a string as written (never a number turned back to text)."""
    argv = []
    for i, arg in enumerate(command):
        if not isinstance(arg, str):
            prev = command[i - 1] if i else None
            after = f" (after {prev!r})" if isinstance(prev, str) else ""
            example = f"command: [..., {prev}, " if isinstance(prev, str) else "command: [..., "
            raise ConfigError(
                f"{where}: command[{i}]{after} is {_as_yaml_read(arg)}, not a string.\n"
                + _QUOTE_HINT.format(example=example + '"...", ...]')
            )
        argv.append(arg)
    return argv


def _env(env: Mapping[object, object], where: str) -> dict[str, str]:
    """The description's ``env``: names and values strings (Kubernetes takes only strings)."""
    out = {}
    for name, value in env.items():
        if not isinstance(name, str):
            raise ConfigError(
                f"{where}: env: a name is {_as_yaml_read(name)}, not a string.\n"
                + _QUOTE_HINT.format(example='"...": value')
            )
        if not isinstance(value, str):
            raise ConfigError(
                f"{where}: env: {name} is {_as_yaml_read(value)}, not a string (Kubernetes "
                "takes only strings).\n" + _QUOTE_HINT.format(example=f'{name}: "..."')
            )
        out[name] = value
    return out


def memory_bytes(quantity: str, key: str = "memory") -> int:
    """A Kubernetes memory quantity (``2Gi``, ``1.5Gi``, ``512M``, ``1e9``) in bytes; ``key``
    names it in errors."""
    m = _QUANTITY.match(str(quantity))
    if not m:
        raise ConfigError(
            f"{key} {quantity!r} is not a Kubernetes memory quantity.\n"
            "HINT: write e.g. 2Gi, 1.5Gi, 512Mi or 4G."
        )
    value = Fraction(m["number"])
    if m["exponent"] is not None:
        value *= Fraction(10) ** int(m["exponent"])
    elif m["suffix"]:
        value *= _SUFFIX_FACTOR[m["suffix"]]
    if value <= 0:
        raise ConfigError(
            f"{key} {quantity!r} is not more than 0 bytes.\nHINT: write e.g. 2Gi or 512Mi."
        )
    if value.denominator != 1:
        # Kubernetes warns of it too: "fractional byte value ... must be an integer".
        raise ConfigError(
            f"{key} {quantity!r} is {float(value):g} bytes, not a whole number of bytes "
            "('m' is milli, not mega).\nHINT: write e.g. 512Mi or 512M."
        )
    return math.floor(value)


def _quantity(size: int) -> str:
    """``size`` bytes as a Kubernetes quantity: the largest binary suffix that divides it."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        factor = int(_SUFFIX_FACTOR[suffix])
        if size % factor == 0:
            return f"{size // factor}{suffix}"
    return str(size)
