"""A secure job resumed under a key the launcher makes: refused before any rank starts.

``ringtrain run --secure`` without ``--key-file`` draws a fresh job key for every run, and a
sealed checkpoint opens only under the key it was sealed with (secure jobs refuse unsealed ones),
so such a ``--resume`` could never load anything: every rank would fail in its load, with an
error that reads like tampering ("failed authentication").
"""

from __future__ import annotations

from collections.abc import Collection

from ringtrain.config import Config
from ringtrain.errors import ConfigError


def check(config: Config, given: Collection[str]) -> None:
    """Raise :class:`ConfigError` if ``config`` resumes in secure mode under the launcher's own
    key (``given``: the Config fields set by flags; the key pipe wins over RINGTRAIN_KEY_FILE
    when ``--secure`` is a flag, as in ``supervisor._makes_key``)."""
    if not (config.secure and config.resume) or "key_file" in given:
        return
    if config.key_file and "secure" not in given:
        return  # RINGTRAIN_SECURE with RINGTRAIN_KEY_FILE: the ranks read that key
    raise ConfigError(
        f"--resume {config.resume!r} in secure mode without --key-file: the launcher makes a "
        "fresh job key for every run, and a sealed checkpoint opens only under the key it was "
        "sealed with (secure jobs load no unsealed one), so no rank could load it.\n"
        "HINT: give the key file of the run that saved it: --secure --key-file FILE; seal new "
        "durable jobs with a key file too (docs/checkpoint.md, Durable jobs)."
    )
