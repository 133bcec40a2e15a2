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


@dataclass(frozen=True)
class Config:
    """Every tunable of a ringtrain job. Build with :meth:`from_env` and :meth:`replace`."""

    # Tensor fusion: allreduces of small tensors are packed into buffers up to this many bytes
    # (DistributedOptimizer: the largest gradient bucket; 0 sends every tensor on its own).
    fusion_threshold_bytes: int = 64 * 1024 * 1024
    # How often the background controller negotiates which collectives are ready (Horovod's
    # cycle time). Lower is lower latency, higher packs more tensors per fused allreduce.
    # DistributedOptimizer: a gradient bucket closes at a gap in backward longer than this.
    cycle_time_ms: float = 1.0
    # Order of DistributedOptimizer's gradient buckets: "auto" (learned from the first step),
    # "reverse" (reverse registration order, as DDP) or "registration".
    bucket_order: str = "auto"
    # Collectives that do not complete within this many seconds fail instead of hanging.
    timeout_s: float = 300.0
    # Stall inspector: warn after this long waiting on ranks that did not submit; 0 disables the
    # inspector, its shutdown included.
    stall_warning_s: float = 60.0
    # Stall inspector: abort the job after this long; 0 means never.
    stall_shutdown_s: float = 0.0
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
    # and compute (with compression="auto"), only where synchronous training cannot reach 80%.
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
    # Durable jobs (ringtrain.checkpoint.Durable; `ringtrain run --checkpoint-dir/-every`):
    # where the job's checkpoints go, and how often: "N" optimizer steps or "Ns" seconds.
    checkpoint_dir: str = ""
    checkpoint_every: str = ""
    # How many of the newest checkpoints to keep (0: all).
    checkpoint_keep: int = 3
    # Continue from the newest complete checkpoint in this directory (`ringtrain run --resume`).
    resume: str = ""

    def __post_init__(self) -> None:
        if self.fusion_threshold_bytes < 0:
            raise ConfigError(
                f"fusion_threshold_bytes must be >= 0, got {self.fusion_threshold_bytes}"
            )
        if self.cycle_time_ms <= 0:
            raise ConfigError(f"cycle_time_ms must be > 0, got {self.cycle_time_ms}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.checkpoint_every:
            checkpoint_schedule(self.checkpoint_every)
        if self.checkpoint_keep < 0:
            raise ConfigError(f"checkpoint_keep must be >= 0, got {self.checkpoint_keep}")
        if self.bucket_order not in ("auto", "registration", "reverse"):
            raise ConfigError(
                "bucket_order must be 'auto', 'registration' or 'reverse', got "
                f"{self.bucket_order!r}"
            )
        if self.hierarchical not in ("auto", "on", "off"):
            raise ConfigError(
                f"hierarchical must be 'auto', 'on' or 'off', got {self.hierarchical!r}"
            )
        if self.link_class not in ("auto", "fast", "slow"):
            raise ConfigError(
                f"link_class must be 'auto', 'fast' or 'slow', got {self.link_class!r}\n"
                "HINT: pin the class that a run with -v logged."
            )
        if self.stall_warning_s < 0 or self.stall_shutdown_s < 0:
            raise ConfigError("stall_warning_s and stall_shutdown_s must be >= 0")
        if self.powersgd_rank < 1 or self.powersgd_start_step < 0:
            raise ConfigError(
                f"powersgd_rank must be >= 1 and powersgd_start_step >= 0, got "
                f"{self.powersgd_rank} and {self.powersgd_start_step}\n"
                "HINT: rank 1 for fine-tuning, 2-4 for training from scratch."
            )
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ConfigError(
                f"topk_ratio must be in (0, 1], got {self.topk_ratio}\n"
                "HINT: 0.01 sends 1% of the gradient entries."
            )
        if self.transport not in ("auto", "gloo", "tcp"):
            raise ConfigError(
                f"transport must be 'auto', 'gloo' or 'tcp', got {self.transport!r}\n"
                "HINT: 'tcp' runs in enclaves (no netlink), 'gloo' is fastest elsewhere."
            )
        every = str(self.sync_every).strip().lower()
        if every != "auto" and not (every.isdigit()):
            raise ConfigError(
                f"sync_every must be a number of steps >= 0 or 'auto', got {self.sync_every!r}\n"
                "HINT: 0 trains synchronously; 100 averages the weights every 100 local steps."
            )
        object.__setattr__(self, "sync_every", every)
        if self.outer_compression not in OUTER_COMPRESSIONS:
            raise ConfigError(
                f"outer_compression must be one of {', '.join(OUTER_COMPRESSIONS)}, got "
                f"{self.outer_compression!r}\nHINT: fp16 halves the outer exchange; int8 and "
                "int4 cut it 4x and 8x, with error feedback."
            )
        if self.outer_delay < 0:
            raise ConfigError(
                f"outer_delay must be a number of inner steps >= 0, got {self.outer_delay}\n"
                "HINT: 0 lets the overlapped exchange take a quarter of the round."
            )
        if self.outer_fragments < 1:
            raise ConfigError(
                f"outer_fragments must be a number of fragments >= 1, got {self.outer_fragments}\n"
                "HINT: 1 exchanges the whole model at the round's end; 4 exchanges a quarter of "
                "it every quarter round."
            )
        if self.engine_streams < 1:
            raise ConfigError(f"engine_streams must be >= 1, got {self.engine_streams}")
        if self.cache_capacity < 0:
            raise ConfigError(f"cache_capacity must be >= 0, got {self.cache_capacity}")
        level = LOG_LEVELS.get(self.log_level.strip().upper())
        if level is None:
            raise ConfigError(
                f"log_level must be one of {', '.join(LOG_LEVELS)} (any case), got "
                f"{self.log_level!r}"
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
        values: dict[str, Any] = horovod_settings(env)
        for var, raw in env.items():
            if not var.startswith(ENV_PREFIX) or var in PLACEMENT_VARS:
                continue
            name = var[len(ENV_PREFIX) :].lower()
            if name not in known:
                raise ConfigError(
                    f"unknown variable {var}={raw!r}.\n"
                    f"HINT: known ones are {', '.join(sorted(env_var(n) for n in known))}."
                )
            values[name] = _parse(known[name], raw, var)
        for name, value in overrides.items():
            if name not in known:
                raise ConfigError(
                    f"unknown ringtrain setting {name!r}; known: {', '.join(sorted(known))}"
                )
            if value is not None:
                values[name] = value
        return cls(**values)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


def _public_fields() -> list[dataclasses.Field[Any]]:
    return [f for f in fields(Config) if not f.name.startswith("_")]


def env_var(name: str) -> str:
    """The environment variable twin of a Config field."""
    return environ.setting_var(name)


def _parse(f: dataclasses.Field[Any], raw: str, var: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
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
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a valid {kind}") from None


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
    if not kind or value <= 0:
        raise ConfigError(
            f"checkpoint_every={every!r} is neither a number of steps nor of seconds.\n"
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
