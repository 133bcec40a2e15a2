"""Which transport carries a job's groups (``transport.backend_choice.Backends.choose``, which
``lifecycle`` hands to the runtime). A secure elastic job takes ringtrain's TCP mesh under
``transport=auto``: the sealed groups of a world it abandons are leaked, and a worker left
waiting in a Gloo receive aborts the process if it returns while the interpreter exits
(docs/elastic.md); the mesh waits in Python."""

from __future__ import annotations

import pytest

from ringtrain.config import Config
from ringtrain.launch.elastic import ID_VAR
from ringtrain.runtime.environment import Placement
from ringtrain.transport import tcp_backend
from ringtrain.transport.backend_choice import Backends

PLACEMENT = Placement("test", 0, 2, "127.0.0.1", 29500)


@pytest.mark.parametrize(
    ("secure", "transport", "elastic", "expected"),
    [
        (True, "auto", True, ("ringtrain_sealed", "tcp")),
        (True, "auto", False, ("ringtrain_sealed", "gloo")),
        (True, "gloo", True, ("ringtrain_sealed", "gloo")),  # asked for: kept
        (False, "auto", True, ("gloo", "gloo")),  # plain groups wait in slices already
        (True, "tcp", False, ("ringtrain_sealed", "tcp")),
    ],
)
def test_secure_elastic_jobs_take_the_tcp_mesh(
    secure: bool, transport: str, elastic: bool, expected: tuple[str, str]
) -> None:
    env = {ID_VAR: "0"} if elastic else {}
    try:
        config = Config(secure=secure, transport=transport)
        assert Backends().choose(config, env, PLACEMENT) == expected
    finally:
        tcp_backend.deconfigure()
