"""One typed configuration object, mapped onto ``RINGTRAIN_*`` variables.

Precedence, everywhere: explicit argument > launcher-provided value (env set by ``ringtrain run``
from its flags) > the user's own env var > default. The launcher turns flags into the same
variables (:func:`to_env`), so a job started by torchrun or Slurm is configured the same way.

The same rule holds for the gradient engine's knobs: an argument of ``DistributedOptimizer``
(``fusion_threshold_bytes``, ``cycle_time_ms``, ``bucket_order``, ``compression``) wins over the
Config field, which comes from ``RINGTRAIN_*`` (set by ``ringtrain run --fusion-threshold-mb`` /
``--cycle-time-ms``, or by hand), which wins over the default.

Each field has exactly one variable twin: ``RINGTRAIN_`` + the field name in upper case.
Unknown ``RINGTRAIN_*`` variables are rejected, so a typo is an error rather than a silent default.

A Horovod job's variables work too: the environment table (:mod:`ringtrain.environ`, where every
variable is named) maps each ``HOROVOD_*`` knob that has a meaning here onto one field, in
Horovod's unit, one level below ``RINGTRAIN_*`` (the twin wins when both are set), and lists the
ones accepted without effect, which ``ringtrain run -v`` names (docs/horovod.md).
This module imports nothing heavy: the launcher uses it too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import pwd
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ringtrain import environ
from ringtrain.environ import LOG_LEVELS, PLACEMENT_VARS, horovod_settings
from ringtrain.errors import ConfigError

ENV_PREFIX = environ.PREFIX

# ringtrain's own compressions, by the names ringtrain.compression registers them under (a test
# holds the two equal). Listed here, torch-free, so that `ringtrain run --compression` is checked
# before any rank starts; a script may register more and name them itself.
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "topk", "auto")
# The local-update step's outer exchange wires (ringtrain.engine.outer_codec.CODECS, a test
# holds the two equal).
OUTER_COMPRESSIONS = ("none", "fp16", "bf16", "int8", "int4")
# ringtrain.checkpoint.Checkpointer's writers ("auto": a thread on the TCP transport).
CHECKPOINT_WRITERS = ("auto", "process", "thread")


@dataclass(frozen=True)
class Config:
    """Every tunable of a ringtrain job. Build with :meth:`from_env` and :meth:`replace`."""

    # Tensor fusion: allreduces of small tensors are packed into buffers up to this many bytes
    # (DistributedOptimizer: the largest gradient bucket; 0 sends every tensor on its own).
    fusion_threshold_bytes: int = 64 * 1024 * 1024
    # Horovod's cycle time. The collectives' controller: a rank with nothing of its own in
    # flight joins its peers' rounds at most this often, and at least 50 ms apart (a submission
    # starts a round at once: collectives.controller.IDLE_NAP_S says why).
    # DistributedOptimizer: a gradient bucket closes at a gap in backward longer than this.
    cycle_time_ms: float = 1.0
    # Order of DistributedOptimizer's gradient buckets: "auto" (learned from the first step),
    # "reverse" (reverse registration order, as DDP) or "registration".
    bucket_order: str = "auto"
    # The transport's timeout: a Gloo/NCCL operation that has started (the engine's buckets, a
    # lane slot, a store read) fails after this many seconds instead of hanging. A negotiated
    # collective whose peers never submit it waits until the stall shutdown time instead.
    timeout_s: float = 300.0
    # Stall inspector: warn after this long waiting on ranks that did not submit; 0 disables the
    # inspector, its shutdown included.
    stall_warning_s: float = 60.0
    # Stall inspector: abort the job after this long; 0 means never.
    stall_shutdown_s: float = 0.0
    # ringtrain run's agents: a rank silent 4 s (no heartbeat) that then does no work for this
    # long (stuck in a driver or the kernel) is killed as frozen and handled like a dead rank.
    frozen_after_s: float = 30.0
    # ringtrain run: ranks get this long after the Ctrl-C or SIGTERM it forwards (time to save a
    # checkpoint) before SIGKILL; a second signal kills at once. Below Kubernetes' default 30 s.
    grace_period_s: float = 20.0
    # Check that ranks submit matching collectives (name, op, shape, dtype, root, process set).
    check_consistency: bool = True
    # Chrome/Perfetto trace written by every rank (rank suffix added); empty disables.
    timeline_filename: str = ""
    # Default gradient compression for DistributedOptimizer, by registered name.
    compression: str = "none"
    # PowerSGD (compression="powersgd"): rank of the low-rank factors (1 for fine-tuning, 2-4
    # from scratch) and the number of steps sent uncompressed first.
    powersgd_rank: int = 2
    powersgd_start_step: int = 10
    # Top-k (compression="topk"): share of gradient entries each rank sends per step.
    topk_ratio: float = 0.01
    # Hierarchical (2D) allreduce: "off", "on" or "auto". DistributedOptimizer uses it for its
    # gradient buckets ("auto": when several hosts and some host runs several ranks). Off by
    # default: it sums within hosts first, so results depend on the host layout.
    hierarchical: str = "off"
    # DistributedOptimizer: process groups its gradient buckets round-robin over, so that
    # consecutive buckets can be in flight at once.
    engine_streams: int = 1
    # Same job, same seed, same weights: nothing measured at run time (gaps in backward, arrival
    # of async ops) changes which values are summed together or in which order. False lets the
    # engine cut buckets at timed gaps and fuse async allreduces of 3+ ranks by arrival.
    reproducible: bool = True
    # DistributedOptimizer's link class, which sets its bucket size: "auto" (measured once in the
    # first step, then fixed), "fast" (32 MiB buckets) or "slow" (4 MiB, for ~1 Gbit/s and below).
    link_class: str = "auto"
    # DistributedOptimizer: shard the optimizer step (ZeRO stage 1): each rank keeps and steps
    # the optimizer state of 1/N of the parameters, then the parameters are all-gathered.
    shard_optimizer: bool = False
    # With shard_optimizer: reduce-scatter the gradients (each rank receives the sum of its own
    # shard only: half an allreduce's bytes), so the sharded step moves what DDP moves. .grad
    # outside the rank's shard then holds its own gradient after step(), until synchronize().
    reduce_scatter: bool = False
    # DistributedOptimizer: step() returns once the last buckets are launched; each bucket's
    # parameters are updated as its reduction completes and the next forward waits per module
    # (cross-iteration overlap, ringtrain.engine.overlap). Opt-in.
    overlap: bool = False
    # DistributedOptimizer: local updates (DiLoCo, ringtrain.engine.local_update): each rank
    # takes this many steps alone, then the averaged change of the weights takes an outer step.
    # "0" trains synchronously; "auto" picks local updates and the number from the measured link
    # and compute (with compression="auto"), only where synchronous training cannot reach 80%;
    # "48,16": one number per rank (a faster rank takes more inner steps a round).
    sync_every: str = "0"
    # The local-update step's outer exchange: "none", "fp16", "bf16", "int8" or "int4" (the
    # narrow ones with error feedback).
    outer_compression: str = "fp16"
    # The local-update step's outer exchange overlapped with the next round's inner steps, its
    # average applied outer_delay inner steps late (streaming DiLoCo). Opt-in: it changes the
    # optimisation.
    outer_overlap: bool = False
    # With outer_overlap: inner steps between sending a round's change and applying its average
    # (1 to sync_every); 0: a quarter of the round, at least 1.
    outer_delay: int = 0
    # The local-update step's parameters cut into this many fragments, each exchanged at its own
    # step of the round (streaming DiLoCo): 1/P of the model on the link at a time.
    outer_fragments: int = 1
    # DistributedOptimizer(batch_shares=...) when not given: each rank's share of the global
    # batch, comma separated in rank order ("3,1"), or "auto" (measured, timing-dependent);
    # "" weighs ranks equally (the plain average).
    batch_shares: str = ""
    # Seal every message with AES-256-GCM and authenticate the rendezvous.
    secure: bool = False
    # Path to the job key (e.g. a mounted Kubernetes Secret) when not started by ringtrain run.
    key_file: str = ""
    # Network interface(s) for Gloo, comma separated; empty means ringtrain picks.
    network_interface: str = ""
    # What carries the ranks' traffic: "gloo", "tcp" (ringtrain's own sockets: for enclaves,
    # where Gloo cannot start without netlink), or "auto" (Gloo unless netlink is missing).
    transport: str = "auto"
    # Report the slowest rank every N optimizer steps; 0 disables.
    straggler_report_steps: int = 0
    # Log level of ringtrain's own logger (Horovod's TRACE and FATAL read as DEBUG and CRITICAL).
    log_level: str = "WARNING"
    # Collectives negotiated before travel as a number, for up to this many distinct requests
    # (Horovod's response cache); 0 sends every request in full.
    cache_capacity: int = 8192
    # An allreduce that repeats a request every rank just ran (same name, shape, dtype, op)
    # starts without a negotiation round (collectives/lane.py). Whether a slot is used depends
    # on timing; the results never do. On by default since the suite ran with it under load.
    fast_lane: bool = True
    # Process sets of at least this many ranks negotiate with one fixed-size bit vector per round
    # (collectives/vector_round.py: one bitwise-AND allreduce, whatever the rank count); smaller
    # ones gather every rank's message, which carries small ops' data too. 0: never.
    vector_rounds_from: int = 4
    # Durable jobs (ringtrain.checkpoint.Durable; `ringtrain run --checkpoint-dir/-every`):
    # where the job's checkpoints go, and how often: "N" optimizer steps or "Ns" seconds.
    checkpoint_dir: str = ""
    checkpoint_every: str = ""
    # How many of the newest checkpoints to keep (0: all).
    checkpoint_keep: int = 3
    # Who writes the saves: "process", "thread" (enclaves) or "auto" (docs/checkpoint.md).
    checkpoint_writer: str = "auto"
    # The process writer's shared-memory buffers' directory ("": /dev/shm, else the temp dir).
    checkpoint_buffers: str = ""
    # Continue from the newest complete checkpoint in this directory (`ringtrain run --resume`).
    resume: str = ""

    # The settings given (an argument, a RINGTRAIN_* or HOROVOD_* variable, a launcher flag)
    # rather than left at their defaults, as from_env and replace were handed them: see
    # given(). Not a field (not annotated): no variable twin, not compared, not in repr.
    _given = frozenset[str]()

    def __post_init__(self) -> None:
        # Types and numbers first, field by field (one rule each, in NUMBERS), so that the
        # rules below compare values of the right type.
        for f in _public_fields():
            object.__setattr__(self, f.name, check_setting(f.name, getattr(self, f.name)))
        if self.checkpoint_every:
            checkpoint_schedule(self.checkpoint_every)
        if self.checkpoint_writer not in CHECKPOINT_WRITERS:
            raise ConfigError(
                f"checkpoint_writer must be one of {', '.join(CHECKPOINT_WRITERS)}, got "
                f"{self.checkpoint_writer!r}\nHINT: 'thread' runs where no process may start."
            )
        if self.bucket_order not in ("auto", "registration", "reverse"):
            raise ConfigError(
                "bucket_order must be 'auto', 'registration' or 'reverse', got "
                f"{self.bucket_order!r}"
            )
        if self.hierarchical not in ("auto", "on", "off"):
            raise ConfigError(
                f"hierarchical must be 'auto', 'on' or 'off', got {self.hierarchical!r}\n"
                "HINT: 'off' keeps results independent of the host layout; 'on' sums within "
                "each host first."
            )
        if self.link_class not in ("auto", "fast", "slow"):
            raise ConfigError(
                f"link_class must be 'auto', 'fast' or 'slow', got {self.link_class!r}\n"
                "HINT: pin the class that a run with -v logged."
            )
        if self.transport not in ("auto", "gloo", "tcp"):
            raise ConfigError(
                f"transport must be 'auto', 'gloo' or 'tcp', got {self.transport!r}\n"
                "HINT: 'tcp' runs in enclaves (no netlink), 'gloo' is fastest elsewhere."
            )
        every = str(self.sync_every).strip().lower().replace(" ", "")
        steps = every.split(",")
        if every != "auto" and not all(s.isdigit() for s in steps):
            raise ConfigError(
                f"sync_every must be a number of steps >= 0, 'auto', or one number per rank, got "
                f"{self.sync_every!r}\nHINT: 0 trains synchronously; 100 averages the weights "
                "every 100 local steps; 48,16 lets rank 0 take 48 steps a round and rank 1 16."
            )
        if len(steps) > 1 and any(int(s) < 1 for s in steps):
            raise ConfigError(
                f"sync_every={self.sync_every!r}: each rank's inner steps a round must be >= 1."
            )
        object.__setattr__(self, "sync_every", every)
        if self.outer_compression not in OUTER_COMPRESSIONS:
            raise ConfigError(
                f"outer_compression must be one of {', '.join(OUTER_COMPRESSIONS)}, got "
                f"{self.outer_compression!r}\nHINT: fp16 halves the outer exchange; int8 and "
                "int4 cut it 4x and 8x, with error feedback."
            )
        object.__setattr__(self, "batch_shares", _check_batch_shares(self.batch_shares))
        level = LOG_LEVELS.get(self.log_level.strip().upper())
        if level is None:
            raise ConfigError(
                f"log_level must be one of {', '.join(LOG_LEVELS)} (any case), got "
                f"{self.log_level!r}\nHINT: ringtrain run -v sets INFO."
            )
        object.__setattr__(self, "log_level", level)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Defaults, then ``RINGTRAIN_*`` variables from ``env``, then ``overrides``.

        Raises :class:`ConfigError` for unknown variables or keys and for unparsable values.
        """
        env = environ.current() if env is None else env
        known = {f.name: f for f in _public_fields()}
        # Horovod's variables first, so that a RINGTRAIN_* twin set as well wins.
        values: dict[str, Any] = {}
        for name, value in horovod_settings(env).items():
            given = [v for v in environ.horovod_vars_of(name) if v in env]
            values[name] = _checked(name, value, " and ".join(f"{v}={env[v]!r}" for v in given))
        for var, raw in env.items():
            if not var.startswith(ENV_PREFIX) or var in PLACEMENT_VARS:
                continue
            name = var[len(ENV_PREFIX) :].lower()
            if name not in known:
                raise ConfigError(
                    f"unknown variable {var}={raw!r}.\n"
                    f"HINT: known ones are {', '.join(sorted(env_var(n) for n in known))}."
                )
            values[name] = _checked(name, _parse(known[name], raw, var), f"{var}={raw!r}")
        for name, value in overrides.items():
            if name not in known:
                raise ConfigError(
                    f"unknown ringtrain setting {name!r}; known: {', '.join(sorted(known))}"
                )
            if value is not None:
                values[name] = value
        return cls(**values)._giving(values)

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes``, which count as given (:meth:`given`) with this one's."""
        return dataclasses.replace(self, **changes)._giving(self._given | set(changes))

    def vector_rounds_at(self, size: int) -> bool:
        """Whether a process set of ``size`` ranks negotiates with vector rounds (and so has
        the 2-rank groups they reduce over: runtime/communicator.py)."""
        return size > 1 and self.cache_capacity > 0 and 0 < self.vector_rounds_from <= size

    def given(self, name: str) -> bool:
        """Whether setting ``name`` was given rather than left at its default: handed to
        :meth:`from_env` (a variable, a launcher flag, ``ringtrain.init(**settings)``) or to
        :meth:`replace` (``DistributedOptimizer``'s arguments), even with the default's value:
        a policy that picks where the user did not (``sync_every="auto"``'s outer exchange)
        leaves a given ``outer_compression="fp16"`` alone. A Config built directly,
        ``Config(...)``, counts the values other than the defaults."""
        field = _field_map().get(name)
        if field is None:
            raise ConfigError(
                f"unknown ringtrain setting {name!r}; known: {', '.join(sorted(_field_map()))}"
            )
        return name in self._given or getattr(self, name) != field.default

    def _giving(self, names: Any) -> Config:
        object.__setattr__(self, "_given", frozenset(names))
        return self


def _public_fields() -> list[dataclasses.Field[Any]]:
    return [f for f in fields(Config) if not f.name.startswith("_")]


@functools.cache
def _field_map() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in _public_fields()}


def _kind(f: dataclasses.Field[Any]) -> str:
    """The field's type by name: "int", "float", "bool" or "str"."""
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


@dataclass(frozen=True)
class Bounds:
    """The numbers a numeric setting or option accepts: finite, at least ``low`` (above it when
    ``above``), at most ``high``, whole when ``whole``. NaN compares false with everything, and
    inf passes every lower bound, so both are refused here explicitly, once for every number
    ringtrain takes (Config fields, launcher and doctor options)."""

    low: float
    above: bool = False
    high: float | None = None
    whole: bool = False
    unit: str = ""
    hint: str = ""

    def expected(self) -> str:
        """``> 0 (a finite number of seconds)``: what a message says the value must be."""
        text = f"{'>' if self.above else '>='} {self.low:g}"
        if self.high is not None:
            text += f" and <= {self.high:g}"
        what = "a whole number" if self.whole else "a finite number"
        return f"{text} ({what}{' of ' + self.unit if self.unit else ''})"

    def check(self, label: str, value: Any, default: Any = None) -> Any:
        """``value`` as an int (``whole``) or float, or :class:`ConfigError` naming ``label``."""
        number: int | float | None = None
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            number = float(value)
            if not math.isfinite(number) or (self.whole and not number.is_integer()):
                number = None
            elif self.whole:
                number = int(number)
        if (
            number is not None
            and (number > self.low if self.above else number >= self.low)
            and (self.high is None or number <= self.high)
        ):
            return number
        hint = self.hint or (
            f"leave it unset for the default, {default!r}." if default is not None else ""
        )
        raise ConfigError(
            f"{label} must be {self.expected()}, got {value!r}"
            + (f"\nHINT: {hint}" if hint else "")
        )


# The one rule of each numeric Config field (a test holds this table to the fields).
NUMBERS: dict[str, Bounds] = {
    "fusion_threshold_bytes": Bounds(0, whole=True, unit="bytes", hint="0 disables fusion."),
    "cycle_time_ms": Bounds(0, above=True, unit="milliseconds"),
    "timeout_s": Bounds(0, above=True, unit="seconds"),
    "stall_warning_s": Bounds(0, unit="seconds", hint="0 turns the stall inspector off."),
    "stall_shutdown_s": Bounds(0, unit="seconds", hint="0 never ends the job for a stall."),
    "frozen_after_s": Bounds(
        0, above=True, unit="seconds", hint="e.g. 120 where a rank may wait that long in a driver."
    ),
    "grace_period_s": Bounds(0, unit="seconds", hint="e.g. 60 where ranks save on SIGTERM."),
    "powersgd_rank": Bounds(
        1, whole=True, hint="rank 1 for fine-tuning, 2-4 for training from scratch."
    ),
    "powersgd_start_step": Bounds(0, whole=True, unit="steps"),
    "topk_ratio": Bounds(0, above=True, high=1, hint="0.01 sends 1% of the gradient entries."),
    "engine_streams": Bounds(1, whole=True, unit="process groups"),
    "outer_delay": Bounds(
        0,
        whole=True,
        unit="inner steps",
        hint="0 lets the overlapped exchange take a quarter of the round.",
    ),
    "outer_fragments": Bounds(
        1,
        whole=True,
        unit="fragments",
        hint="1 exchanges the whole model at the round's end; 4 exchanges a quarter of it "
        "every quarter round.",
    ),
    "straggler_report_steps": Bounds(0, whole=True, unit="steps", hint="0 turns reports off."),
    "cache_capacity": Bounds(0, whole=True, unit="requests", hint="0 turns the cache off."),
    "vector_rounds_from": Bounds(
        0, whole=True, unit="ranks", hint="0 keeps gathered rounds at every size."
    ),
    "checkpoint_keep": Bounds(0, whole=True, unit="checkpoints", hint="0 keeps them all."),
}


def check_setting(name: str, value: Any) -> Any:
    """``value`` checked as Config field ``name`` takes it (and converted: an int where a
    float is expected, a whole float where an int is, a number where text is), or
    :class:`ConfigError`. The type and number rules of every field, in one place."""
    f = _field_map()[name]
    kind = _kind(f)
    if kind in ("int", "float"):
        return NUMBERS[name].check(name, value, f.default)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, numbers.Integral) and value in (0, 1):
            return bool(value)
        raise ConfigError(
            f"{name} must be true or false, got {value!r}\n"
            f"HINT: as a variable, {env_var(name)}=1 or 0."
        )
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(value)  # as its variable twin would carry it (sync_every: 100)
    raise ConfigError(f"{name} must be text, got {value!r}")


def env_var(name: str) -> str:
    """The environment variable twin of a Config field."""
    return environ.setting_var(name)


def _checked(name: str, value: Any, source: str) -> Any:
    """:func:`check_setting`, its error prefixed with where the value came from."""
    try:
        return check_setting(name, value)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}" if source else str(e)) from None


def _parse(f: dataclasses.Field[Any], raw: str, var: str) -> Any:
    kind = _kind(f)
    try:
        if kind == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if kind == "int":
            return int(float(raw)) if "e" in raw.lower() else int(raw)
        if kind == "float":
            return float(raw)
        return raw
    except (ValueError, OverflowError):  # OverflowError: int(float("1e400"))
        raise ConfigError(f"{var}={raw!r} is not a valid {kind}\nHINT: {_EXAMPLES[kind]}") from None


_EXAMPLES = {
    "bool": "1 or 0 (true/false, yes/no and on/off read too).",
    "int": "a whole number, digits only (e.g. 100).",
    "float": "a plain number, without units (e.g. 2.5).",
}


def settings_from(values: Mapping[str, Any], where: str = "settings:") -> dict[str, Any]:
    """Config settings given as a mapping (a file's ``settings:``, ``--set`` pairs): each value
    of its field's type, or text its ``RINGTRAIN_*`` twin would accept (``"30"``, ``"true"``).
    Returns them checked and converted, as :class:`Config` holds them; errors name ``where``
    and the key. Together with :func:`check_launch_settings`, the rules ``ringtrain run``
    applies to its flags."""
    known = {f.name: f for f in _public_fields()}
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name not in known:
            raise ConfigError(
                f"{where} {name}: unknown ringtrain setting.\n"
                f"HINT: known ones are {', '.join(sorted(known))}."
            )
        if isinstance(value, str) and _kind(known[name]) != "str":
            value = _parse(known[name], value, f"{where} {name}")
        out[name] = _checked(name, value, f"{where} {name}={value!r}")
    config = Config.from_env({}, **out)  # the rules between fields
    return {name: getattr(config, name) for name in out}


def check_launch_settings(config: Config, given: Mapping[str, str]) -> None:
    """The rules for settings a launcher hands every rank, beyond each field's own: ``given``
    maps each setting the user gave the launcher (``ringtrain run``'s flags, ``ringtrain k8s``'s
    ``settings``) to how it was given (``--compression``). A compression given there must be
    one of ringtrain's: a script that registers its own names it in the script."""
    if "compression" in given and config.compression not in COMPRESSIONS:
        raise ConfigError(
            f"{given['compression']} {config.compression!r} is not one of ringtrain's "
            f"compressions ({', '.join(COMPRESSIONS)}).\n"
            "HINT: a compression your script registers (ringtrain.compression.register) is "
            "chosen in the script: DistributedOptimizer(compression=...)."
        )


def check_path(label: str, path: str, *, directory: bool = False, writable: bool = True) -> None:
    """A file (or ``directory``) ``path`` that ranks or the launcher will create can be created
    on this host: no ancestor is a file, the nearest existing one is writable (unless not
    ``writable``: a path only read), and an existing ``path`` is of the kind wanted. Raises :class:`ConfigError` starting with ``label`` (the
    flag or setting and the value given), naming the obstacle; checked before any rank starts,
    instead of one ``FileExistsError`` per rank."""
    full = os.path.abspath(path)
    want = "a directory" if directory else "a file"
    if os.path.exists(full):
        if os.path.isdir(full) != directory:
            raise ConfigError(
                f"{label}: {full} is {'a directory' if os.path.isdir(full) else 'a file'}, "
                f"not {want}.\nHINT: give another path, or move {full} away."
            )
        existing = full if directory else os.path.dirname(full)
    else:
        existing = os.path.dirname(full)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ConfigError(
                f"{label}: {existing} is a file, not a directory, so nothing can be created "
                f"under it.\nHINT: give a path whose parents are directories, or move "
                f"{existing} away."
            )
    if writable and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{label}: this user ({_user()}) cannot write in {existing}.\n"
            "HINT: give a path in a directory you can write to."
        )
    if writable:  # root passes os.access where nothing can be created (/proc, a read-only mount)
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as e:
            raise ConfigError(
                f"{label}: nothing can be created in {existing}: {e.strerror}.\n"
                "HINT: give a path in a directory you can write to."
            ) from None


def _user() -> str:
    # The real uid's name, as os.access checks it: not $USER, which su or sudo may leave as it was.
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # no passwd entry (a container's arbitrary uid)
        return f"uid {os.getuid()}"


def checkpoint_schedule(every: str) -> tuple[str, float]:
    """``"100"`` -> ("steps", 100); ``"300s"`` -> ("seconds", 300.0)."""
    text = every.strip().lower()
    try:
        if text.endswith("s"):
            value: float = float(text[:-1])
            kind = "seconds"
        else:
            value = int(text)
            kind = "steps"
    except ValueError:
        value, kind = 0, ""
    if not kind or not 0 < value < math.inf:  # also nan: "nans" parses as a float
        raise ConfigError(
            f"checkpoint_every={every!r}: expected a positive number of steps or of seconds.\n"
            "HINT: --checkpoint-every 100 saves every 100 optimizer steps, 300s every 5 minutes."
        )
    return kind, value


def to_env(**settings: Any) -> dict[str, str]:
    """Render settings as the ``RINGTRAIN_*`` variables the launcher passes to every rank."""
    known = {f.name for f in _public_fields()}
    out: dict[str, str] = {}
    for name, value in settings.items():
        if name not in known:
            raise ConfigError(f"unknown ringtrain setting {name!r}")
        if value is None:
            continue
        out[env_var(name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


def _check_batch_shares(value: str) -> str:
    """``batch_shares``: "", "auto", or positive numbers separated by commas (normalised)."""
    text = str(value).strip().lower()
    if text in ("", "auto"):
        return text
    try:
        shares = [float(v) for v in text.split(",")]
    except ValueError:
        shares = []
    if not shares or any(not s > 0 or s == float("inf") for s in shares):
        raise ConfigError(
            f"batch_shares must be positive numbers separated by commas (one per rank) or "
            f"'auto', got {value!r}\nHINT: RINGTRAIN_BATCH_SHARES=3,1 gives rank 0 three samples "
            "for every one of rank 1's."
        )
    return ",".join(text.replace(" ", "").split(","))
