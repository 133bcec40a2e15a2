"""What runs inside a Ray worker process before the user's function: facts and environment.

These functions travel to the workers by reference (``ringtrain.ray.worker.<name>``), so each
worker imports ringtrain, not the driver's copy of it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ringtrain import environ
from ringtrain.ray.placement import WorkerFacts
from ringtrain.security import keys

R = TypeVar("R")


def facts() -> WorkerFacts:
    import ray

    ctx = ray.get_runtime_context()
    return WorkerFacts(
        node_ip=ray.util.get_node_ip_address(),
        node_id=ctx.get_node_id(),
        hostname=socket.gethostname(),
        pid=os.getpid(),
    )


def set_environment(env: Mapping[str, str], key: bytes | None = None) -> int:
    """Export ``env`` in this process; with ``key``, hand the job key to ``hvd.init()`` through
    a pipe (``RINGTRAIN_KEY_FD``) as ``ringtrain run --secure`` does: never in the environment,
    argv or a file. Returns this process's pid."""
    environ.update(env)
    if key is not None:
        keys.forget_pipe_keys()  # an actor reused for a new job: this pipe holds a new key
        read_end, write_end = os.pipe()
        os.write(write_end, keys.encode_key(key))
        os.close(write_end)
        environ.set_var(keys.KEY_FD_VAR, str(read_end))
    return os.getpid()


class Worker:
    """The actor class of :class:`ringtrain.ray.RayExecutor`: Horovod's worker contract
    (``execute(fn)`` calls ``fn(executable)``)."""

    def __init__(self) -> None:
        self.executable: object = None

    def facts(self) -> WorkerFacts:
        return facts()

    def set_environment(self, env: Mapping[str, str], key: bytes | None = None) -> int:
        return set_environment(env, key)

    def start_executable(
        self,
        executable_cls: type | None,
        args: Sequence[object] | None,
        kwargs: Mapping[str, object] | None,
    ) -> None:
        if executable_cls is not None:
            self.executable = executable_cls(*(args or []), **(kwargs or {}))

    def execute(self, fn: Callable[[Any], R]) -> R:
        try:
            return fn(self.executable)
        except Exception:
            # Ray catches what fn raised, so no except hook tells the peers: leave the job as a
            # failing rank does (shutdown() in an except block posts the exception), so that
            # their waits end naming it within seconds, not at the transport timeout, and the
            # executor's next run() starts a world afresh.
            import ringtrain

            ringtrain.shutdown()
            raise
