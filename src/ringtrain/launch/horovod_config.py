"""horovodrun's ``--config-file``: its YAML file of job settings, read as horovodrun reads it.

horovodrun turns each key of the file into the ``HOROVOD_*`` variable its ranks get (Horovod's
``runner/common/util/config_parser.py``), a flag given on the command line winning over the
file's key. ``ringtrain run`` does the same and reads those variables through the one table of
Horovod's variables (``environ.HOROVOD_VARS``): a key with a meaning here sets its Config field,
in Horovod's unit; a key without one (``environ.HOROVOD_UNUSED``) is named in one line with why.
Two things differ, both to fail early: a key horovodrun does not read (a typo) is an error, where
horovodrun skips it, and a switch must be true or false, where horovodrun reads any text as true.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ringtrain import environ
from ringtrain.config import Config, check_setting
from ringtrain.errors import ConfigError
from ringtrain.launch import horovodrun

MiB = 1024 * 1024


def _plain(value: object) -> str:
    return str(value)


def _megabytes(value: object) -> str:
    """horovodrun's fusion_threshold_mb, passed on in bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(int(value * MiB))
    return str(value)  # not a number: the variable's parser names what it expects


def _switch(value: object) -> str:
    if isinstance(value, bool) or value in (0, 1):
        return "1" if value else "0"
    raise ValueError(value)


def _switch_off(value: object) -> str:
    """stall_check.enabled, passed on as HOROVOD_STALL_CHECK_DISABLE."""
    return "0" if _switch(value) == "1" else "1"


# How horovodrun writes a key's value into its variable (the kinds of environ.HOROVOD_CONFIG_KEYS).
WRITERS: dict[str, Callable[[object], str]] = {
    "plain": _plain,
    "mib": _megabytes,
    "switch": _switch,
    "switch_off": _switch_off,
}
CONTROLLERS = {"gloo": horovodrun.NOT_NEEDED["gloo"], "mpi": horovodrun.NOT_NEEDED["mpi"]}


@dataclass(frozen=True)
class FileSettings:
    """What a config file asks of the job: Config fields (Horovod's units converted) and one
    line for each key that has no effect here."""

    settings: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def add_flag(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--config-file",
        metavar="FILE",
        help="horovodrun's YAML file of settings (params, timeline, stall_check, "
        "library_options, logging); a flag given wins over the file's key",
    )


def read(path: str | None) -> FileSettings:
    """The settings the file at ``path`` gives (none without a file), or :class:`ConfigError`
    naming the file and the key."""
    if path is None:
        return FileSettings()
    where = f"--config-file {path}"
    doc = _load(path, where)
    settings: dict[str, Any] = {}
    notes = []
    unused: dict[str, list[str]] = {}  # why -> the keys without effect, one line for each why
    for section, body in doc.items():
        if section == "controller":
            notes.append(f"{where}: controller: {_controller(body, where)}")
            continue
        keys = environ.HOROVOD_CONFIG_KEYS.get(str(section))
        if keys is None:
            raise ConfigError(
                f"{where}: {section!r} is not a section horovodrun reads.\n"
                f"HINT: its sections are controller, {', '.join(environ.HOROVOD_CONFIG_KEYS)}."
            )
        if body is None:
            continue
        if not isinstance(body, Mapping):
            raise ConfigError(
                f"{where}: {section} must hold keys (key: value), got {body!r}.\n"
                f"HINT: put its keys on the lines below it, indented ('  {next(iter(keys))}: ...')."
            )
        variables = _variables(str(section), body, keys, where)
        if section == "autotune" and variables.get("HOROVOD_AUTOTUNE", ("", "", 0))[1] != "1":
            variables = {}  # horovodrun passes the autotuner's keys on only when it is on
        for var, (key, raw, given) in sorted(variables.items(), key=_table_order):
            settings.update(_setting(var, key, raw, given, where))
            why = dict(environ.horovod_unused({var: raw})).get(var)
            if why is not None and raw not in ("", "0"):
                unused.setdefault(why, []).append(key)
    for why, named in unused.items():
        notes.append(f"{where}: {', '.join(named)}: no effect here ({why})")
    return FileSettings(settings, tuple(notes))


def _table_order(item: tuple[str, object]) -> int:
    """Variables in the table's order, where two feed one field: HOROVOD_STALL_CHECK_DISABLE
    beats HOROVOD_STALL_CHECK_TIME_SECONDS in a file as in the environment."""
    order = list(environ.HOROVOD_VARS)
    return order.index(item[0]) if item[0] in order else len(order)


def _load(path: str, where: str) -> Mapping[object, object]:
    try:
        import yaml  # only here: PyYAML is an extra (ringtrain[k8s])
    except ImportError:
        raise ConfigError(
            f"{where}: reading YAML needs PyYAML, which is not installed.\n"
            "HINT: pip install PyYAML (or pip install 'ringtrain[k8s]'), or give the file's "
            "settings as flags."
        ) from None
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(
            f"{where}: cannot read it: {e.strerror or e}.\n"
            f"HINT: give the path of horovodrun's YAML file (from {os.getcwd()})."
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {e}") from None
    if doc is None:
        return {}
    if not isinstance(doc, Mapping):
        raise ConfigError(
            f"{where}: the file must hold sections (params:, timeline:, ...), got "
            f"{type(doc).__name__} {doc!r:.80}."
        )
    return doc


def _controller(value: object, where: str) -> str:
    why = CONTROLLERS.get(str(value).lower())
    if why is None:
        raise ConfigError(
            f"{where}: controller: {value!r} is not a controller horovodrun knows.\n"
            "HINT: gloo or mpi (neither is needed: ringtrain run starts the ranks itself)."
        )
    return why


def _variables(
    section: str,
    body: Mapping[object, object],
    keys: dict[str, tuple[str, str]],
    where: str,
) -> dict[str, tuple[str, str, object]]:
    """``{variable: (section.key, value as horovodrun writes it, value in the file)}`` for the
    keys set."""
    out = {}
    for key, value in body.items():
        name = f"{section}.{key}"
        entry = keys.get(key) if isinstance(key, str) else None
        if entry is None:
            raise ConfigError(
                f"{where}: {name} is not a key horovodrun reads.\n"
                f"HINT: the keys of {section} are {', '.join(keys)}."
            )
        if value is None:
            continue
        var, kind = entry
        try:
            out[var] = (name, WRITERS[kind](value), value)
        except ValueError:
            raise ConfigError(
                f"{where}: {name} must be true or false, got {value!r}.\n"
                "HINT: write it without quotes: true or false."
            ) from None
    return out


def _setting(var: str, key: str, raw: str, given: object, where: str) -> dict[str, Any]:
    """The Config field ``var`` sets (none for a variable without a meaning here), checked by
    the variable's parser and the field's own rule; the error names the key."""
    hv = environ.HOROVOD_VARS.get(var)
    if hv is None:
        return {}
    try:
        value = hv.parse(raw)
    except ValueError:
        raise ConfigError(
            f"{where}: {key}: {given!r} is not valid: horovodrun passes it on as {var}={raw}, "
            f"which must be {hv.parse.__doc__}.\n"
            f"HINT: ringtrain reads {var} as {hv.field}; docs/horovod.md lists the variables."
        ) from None
    if value is None:  # "no change", as HOROVOD_STALL_CHECK_DISABLE=0
        return {}
    try:
        value = check_setting(hv.field, value)
        Config(**{hv.field: value})  # the field's own rule
    except ConfigError as e:
        raise ConfigError(f"{where}: {key}: {e}") from None
    return {hv.field: value}
