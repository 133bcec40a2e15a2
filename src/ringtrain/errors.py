"""The exception tree. Every error ringtrain raises on purpose is one of these.

    RingtrainError                      base: catch this to catch everything below
    ├── ConfigError (ValueError)         a setting, flag or env var is wrong
    ├── NotInitializedError (ValueError) an API call before ringtrain.init()
    ├── LaunchEnvironmentError           the launcher's variables contradict each other or the code
    ├── HorovodInternalError (RuntimeError)  a collective failed (Horovod's name); elastic: a peer
    │   │                                    failed, restore the last commit
    │   └── CollectiveError              a collective failed; the same error is raised on every rank
    │       ├── CollectiveArgumentError (ValueError)  bad arguments (root, splits, dtype, name, ...)
    │       │   ├── StepOrderError (AssertionError)  DistributedOptimizer's calls out of order
    │       │   └── CollectiveUnsupportedError (NotImplementedError)  an op ringtrain lacks (Adasum)
    │       ├── CollectiveMismatchError     ranks submitted the same name with different arguments
    │       ├── StallError                  ranks stopped submitting what others wait for
    │       └── CollectiveAbortedError      the job shut down while the op was in flight
    │           └── PeerFailedError         a named peer failed or left while this rank waited
    ├── HostsUpdatedInterrupt (RuntimeError)  elastic: hosts joined or left; re-form the world
    ├── SecurityError                   a message failed authentication or a peer lacks the key
    ├── CheckpointError                 a checkpoint is incomplete, damaged, or cannot be written
    ├── LaunchError                     the launcher could not start or keep the job running
    │   ├── HostSpecError (ValueError)  a -H / --hostfile entry could not be parsed
    │   ├── MissingRanksError           ranks never arrived in init() (exited first, or stuck)
    │   └── JobFailedError (RuntimeError)  ringtrain.run's job failed (horovod.run raises so)
    │       └── JobPreemptedError       it stopped on a preemption at a step it saved
    └── InternalError                   a bug in ringtrain itself: please report it

Messages say what was given, what was expected, and what to do (``HINT:``).

The builtin bases are Horovod's: its collectives fail with ``HorovodInternalError``, a
``RuntimeError`` (every :class:`CollectiveError` is a :class:`HorovodInternalError`), its
argument checks raise ``ValueError``, unsupported ops ``NotImplementedError``, and its queries
before ``init()`` ``ValueError``. So ``except RuntimeError`` around a collective catches a
mismatch in either library.
"""

from __future__ import annotations

from collections.abc import Sequence


def by_rank(given: Sequence[object], ranks: Sequence[int] | None = None) -> list[str]:
    """What the ranks gave, for an error saying they differ: one line ``"  rank(s) 0, 2: v"``
    per value (ranks that gave the same share it), at most five lines of at most eight ranks,
    so the message stays short at any world size. ``ranks``: the world ranks of ``given``'s
    entries (default: their positions)."""
    who: dict[str, list[int]] = {}
    for r, value in zip(range(len(given)) if ranks is None else ranks, given):
        who.setdefault(str(value), []).append(r)
    lines = []
    for value, rs in list(who.items())[:5]:
        more = f" and {len(rs) - 8} more" if len(rs) > 8 else ""
        lines.append(f"  rank(s) {', '.join(map(str, rs[:8]))}{more}: {value}")
    return lines + ([f"  and {len(who) - 5} other values"] if len(who) > 5 else [])


# What unequal data needs, said wherever a rank ran fewer collectives or steps than its peers:
# join() stands in for a finished rank in explicit collectives only, not in the gradient
# exchange of DistributedOptimizer.step() (docs/engine.md, Limits).
UNEVEN_DATA = (
    "for uneven data, end every rank at the same step (the smallest count over the ranks: an "
    "allreduce with op=Min), or, where the others run only explicit collectives, call "
    "ringtrain.join() in a rank whose data ran out (it does not stand in for step())"
)
# A peer that ran fewer collectives ended this rank's (Horovod's rule), and none failed.
RAN_FEWER = (
    "every rank must submit the same collectives; a rank that ran fewer ends the others' "
    f"(Horovod's rule); {UNEVEN_DATA}."
)


class RingtrainError(Exception):
    """Base of every error ringtrain raises on purpose."""


class ConfigError(RingtrainError, ValueError):
    """A configuration value, flag or environment variable is invalid."""


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value is of the wrong type, where Horovod raises ``TypeError``."""


class NotInitializedError(RingtrainError, ValueError):
    """The call needs ``ringtrain.init()`` first."""

    def __init__(self, what: str = "this call") -> None:
        super().__init__(
            f"{what} needs ringtrain to be initialized.\n"
            "HINT: call ringtrain.init() (or hvd.init()) at the start of the training script."
        )


class LaunchEnvironmentError(RingtrainError):
    """The variables of the launcher that started this process are inconsistent."""


class HorovodInternalError(RingtrainError, RuntimeError):
    """A collective failed (Horovod's name and base class, so ``except HorovodInternalError``
    catches what it catches in Horovod). Raised as such when a peer failed; ``@elastic.run``
    then restores the last commit, re-forms the world with the survivors and retries."""


class CollectiveError(HorovodInternalError):
    """A collective operation failed. Raised on every rank that took part."""


class CollectiveArgumentError(CollectiveError, ValueError):
    """A collective was called with invalid arguments."""


class StepOrderError(CollectiveArgumentError, AssertionError):
    """DistributedOptimizer's calls came out of order: ``zero_grad()`` between a backward pass
    and ``step()``, or more backward passes than ``backward_passes_per_step`` before it. An
    ``AssertionError`` too, as Horovod raises there, so ``except AssertionError`` still works."""


class CollectiveUnsupportedError(CollectiveArgumentError, NotImplementedError):
    """The collective asks for something ringtrain does not do (``op=Adasum``)."""


class CollectiveMismatchError(CollectiveError):
    """Ranks submitted collectives with the same name but different arguments."""


class StallError(CollectiveError):
    """Some ranks stopped submitting collectives that other ranks are waiting on."""


class CollectiveAbortedError(CollectiveError):
    """The operation could not finish because ringtrain shut down or a peer failed."""


class PeerFailedError(CollectiveAbortedError):
    """A peer that this rank waited for failed or left the job; ``ranks`` names them (their
    own words are in the message: see :mod:`ringtrain.runtime.departures`)."""

    def __init__(
        self,
        message: str,
        ranks: tuple[int, ...] = (),
        exits_unread: bool = False,
        preempted: bool = False,
    ) -> None:
        super().__init__(message)
        self.ranks = ranks
        # Told only that they left (their script ended, none heard failing): their exit codes,
        # not yet read, may say otherwise (runtime.departures.with_exit_codes).
        self.exits_unread = exits_unread
        # Each stopped on a preemption at a step saved with this rank: nothing failed.
        self.preempted = preempted


class SecurityError(RingtrainError):
    """A message failed authentication, or a peer could not prove it holds the job key."""


class HostsUpdatedInterrupt(RingtrainError, RuntimeError):
    """The launcher announced a new membership (Horovod's name). Raised by
    ``state.check_host_updates()``/``commit()`` on every rank at once; nothing is lost, so
    ``@elastic.run`` re-forms the world without restoring. ``skip_sync`` as in Horovod."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the job changed; the world will be re-formed")
        self.skip_sync = skip_sync


class CheckpointError(RingtrainError):
    """A checkpoint could not be written, or is incomplete or damaged (the message names the
    file)."""


class LaunchError(RingtrainError):
    """The launcher could not start, or keep running, the job."""


class MissingRanksError(LaunchError):
    """Ranks of the job never arrived in ``init()`` (they exited first, or never called it);
    ``ranks`` names them."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class StartTimeoutError(LaunchError, TimeoutError):
    """The job's processes did not all start within the time given for it."""


class HostSpecError(LaunchError, ValueError):
    """A host specification could not be parsed."""


class JobFailedError(LaunchError, RuntimeError):
    """The job that ``ringtrain.run`` started failed; ``exit_code`` is the launcher's."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class JobPreemptedError(JobFailedError):
    """The job that ``ringtrain.run`` started stopped on a preemption (SIGTERM) at a step it
    saved (a durable job: ringtrain.checkpoint.Durable): nothing failed, and running it again
    with ``resume`` set continues from that step. A JobFailedError still, as Horovod's
    ``horovod.run`` raises RuntimeError for any job that did not end well."""


class InternalError(RingtrainError):
    """A bug in ringtrain. Please report it with the full message."""
