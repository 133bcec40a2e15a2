"""Local updates' settings: ``sync_every`` parsed, the settings that do not combine with it
refused and what the user gave of the outer exchange (:mod:`ringtrain.engine.local_policy`
decides, :mod:`ringtrain.engine.local_first` for ``sync_every="auto"``; this module reads the
Config). :class:`ringtrain.engine.local_update.LocalUpdate` is what runs them.
"""

from __future__ import annotations

from typing import Any

from ringtrain.config import Config
from ringtrain.engine import local_policy, weighting
from ringtrain.errors import ConfigError

# sync_every as the engine holds it: 0 (synchronous), a number of inner steps per round, "auto"
# (until its first round decides), or one number per rank (rank r takes SyncEvery[r] a round).
SyncEvery = int | str | tuple[int, ...]


def parse_sync_every(value: Any) -> SyncEvery:
    """``sync_every`` as given (an int, a numeric string, "auto", None/"off"/0 for
    synchronous training, or one number per rank: a list, or "48,16"): an int >= 0
    (0 = synchronous), "auto", or a tuple of ints >= 1."""
    if isinstance(value, (list, tuple)) or (isinstance(value, str) and "," in value):
        return _per_rank(value)
    if value is None:
        return 0
    if isinstance(value, bool):
        raise bad_sync_every(value)
    if isinstance(value, int):
        if value < 0:
            raise bad_sync_every(value)
        return value
    text = str(value).strip().lower()
    if text in ("", "off", "none"):
        return 0
    if text == "auto":
        return "auto"
    try:
        number = int(text)
    except ValueError:
        raise bad_sync_every(value) from None
    if number < 0:
        raise bad_sync_every(value)
    return number


def _per_rank(value: Any) -> tuple[int, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    steps = []
    for item in items:
        every = parse_sync_every(item) if not isinstance(item, (list, tuple)) else None
        if not isinstance(every, int) or every < 1 or isinstance(item, bool):
            raise bad_sync_every(value)
        steps.append(every)
    if not steps:
        raise bad_sync_every(value)
    return tuple(steps)


def round_steps(every: SyncEvery, rank: int, size: int) -> int:
    """Rank ``rank``'s inner steps a round (``every`` a number > 0, or one per rank)."""
    if not isinstance(every, tuple):
        assert isinstance(every, int) and every > 0, every
        return every
    if len(every) != size:
        raise ConfigError(
            f"sync_every has {len(every)} entries {list(every)} but the process set has {size} "
            "ranks.\nHINT: give one number of inner steps per rank (in rank order), or one "
            "number for every rank."
        )
    return every[rank]


def outer_weight(
    every: SyncEvery, shares: tuple[float, ...] | None, rank: int, size: int
) -> float | None:
    """Rank ``rank``'s weight in the outer average: the samples it takes a round (its inner
    steps times its share of each global batch, ``batch_shares``) over every rank's; None where
    the plain mean is the same (equal products)."""
    steps = [round_steps(every, r, size) for r in range(size)]
    if shares is not None and len(shares) != size:
        return weighting.weight_of(shares, rank, size)  # raises: one share per rank
    parts = [h * s for h, s in zip(steps, shares or [1.0] * size)]
    return weighting.weight_of(parts, rank, size)


def outer_delay(delay: int, sync_every: int) -> int:
    """The overlapped exchange's delay in inner steps: ``delay`` (at most a round), or for 0 a
    quarter of the round, at least one step (streaming DiLoCo's few steps: about 3% more steps
    to the tiny LM's target than applying it at once, against twice for a whole round)."""
    return min(delay, sync_every) if delay > 0 else max(1, sync_every // 4)


def bad_sync_every(value: Any) -> ConfigError:
    return ConfigError(
        f"sync_every must be a number of steps >= 0, 'auto', or one number >= 1 per rank, got "
        f"{value!r}\nHINT: 0 trains synchronously; 100 averages the weights every 100 local "
        "steps; 'auto' decides from the measured link and compute; [48, 16] lets rank 0 take 48 "
        "inner steps a round and rank 1 16 (a faster rank does more, each weighs by its samples)."
    )


def check(config: Config) -> None:
    """Local updates with settings that make no sense with them: a clear error."""
    given = parse_sync_every(config.sync_every)
    every = min(given) if isinstance(given, tuple) else given  # per rank: the shortest round
    if config.outer_delay and not config.outer_overlap:
        raise ConfigError(
            f"outer_delay={config.outer_delay} says how many inner steps the overlapped outer "
            "exchange may take, but outer_overlap is off.\nHINT: add outer_overlap=True, or "
            "drop outer_delay."
        )
    if isinstance(every, int) and every > 0 and config.outer_delay > every:
        raise ConfigError(
            f"outer_delay={config.outer_delay} is longer than a round (sync_every={given}): "
            "each average must be applied before the next round's exchange starts.\nHINT: "
            f"outer_delay={every} at most (or 0: a quarter of the round)."
        )
    if isinstance(every, int) and config.outer_fragments > max(every, 1):
        raise ConfigError(
            f"outer_fragments={config.outer_fragments} "
            + (
                f"is more than the round's {every} inner steps: each fragment is exchanged at "
                f"its own step.\nHINT: outer_fragments={every} at most."
                if every
                else "cuts local updates' outer exchange, but sync_every is off (synchronous)."
                "\nHINT: set sync_every (e.g. 16), or drop outer_fragments."
            )
        )
    clash = clashes(config)
    if isinstance(every, int) and every > 0 and clash:
        raise ConfigError(
            f"sync_every={given} (local updates) cannot be combined with {clash}: no "
            "gradient is exchanged between outer steps, so there is nothing to shard or "
            f"overlap.\nHINT: drop {clash}, or sync_every."
        )


def clashes(config: Config) -> str:
    """The settings of ``config`` that make no sense with local updates ("" when none)."""
    on = (("shard_optimizer", config.shard_optimizer), ("overlap", config.overlap))
    return " and ".join(name for name, value in on if value)


def auto_compression(compression: Any, config: Config) -> Any:
    """``sync_every="auto"`` chooses the exchange itself: local updates, or synchronous training
    whose compression ``compression="auto"`` chooses; the compression to use (an explicit
    other one is an error: auto would not be choosing)."""
    given = config.compression if compression is None else compression
    if given in ("auto", "none"):
        return "auto"
    raise ConfigError(
        f"sync_every='auto' chooses the exchange (local updates, or synchronous training with "
        f"compression='auto'), but compression is {given!r}.\nHINT: leave compression unset (or 'auto') with sync_every='auto', or set "
        "sync_every to a number of steps."
    )


def given_outer(config: Config) -> local_policy.Given:
    """The user's outer settings as :mod:`ringtrain.engine.local_policy` takes them: each one
    the user gave (:meth:`ringtrain.config.Config.given`: an argument, a variable, a launcher
    flag, even with the default's value, ``outer_compression="fp16"`` or ``outer_overlap=False``)
    or None for the policy to pick. ``outer_delay`` 0 asks for the fitted delay: not given."""
    return (
        config.outer_compression if config.given("outer_compression") else None,
        config.outer_overlap if config.given("outer_overlap") else None,
        config.outer_delay or None,
    )
