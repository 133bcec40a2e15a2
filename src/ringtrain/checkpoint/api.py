"""``save`` and ``load``: a job's model, optimizer, data position and RNG, at any world size.

Both are collective when ringtrain is initialized (every rank calls them, alike); without
``init()`` they work on the one process. See docs/checkpoint.md for what is saved and the
resharding rules.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ringtrain.checkpoint import (
    local_state,
    manifest,
    optimizer_state,
    parts,
    samplers,
    sealed,
    store,
)
from ringtrain.checkpoint.layout import Item
from ringtrain.checkpoint.manifest import Manifest
from ringtrain.errors import CheckpointError, ConfigError, RingtrainError, SecurityError, by_rank

if TYPE_CHECKING:
    from ringtrain.config import Config

T = TypeVar("T")


@dataclass
class Restored:
    """What :func:`load` found besides what it put into the objects it was given."""

    directory: str
    step: int
    saved_world_size: int
    extra: Any = None
    # The rest of the epoch: the sampler (a ShareSampler's batches), or Remaining.
    data: Iterable[int] | Iterable[list[int]] | None = None
    manifest: Manifest = field(default_factory=lambda: Manifest())

    @property
    def run(self) -> str:
        """The run the checkpoint belongs to ("" if it records none): give it to
        :class:`ringtrain.checkpoint.Checkpointer` (``run=``) to continue that run's series,
        whose keep-last then counts the checkpoints it continues from."""
        run = self.manifest.get("run")
        return run if isinstance(run, str) else ""


def _where() -> tuple[int, int, Config]:
    from ringtrain.config import Config
    from ringtrain.runtime import state as runtime

    if runtime.is_initialized():
        rt = runtime.current()
        return rt.rank, rt.size, rt.config
    return 0, 1, Config.from_env()


def world() -> tuple[int, int]:
    """Which world this process is in: (generation, size); a new elastic world is another."""
    from ringtrain.runtime import state as runtime

    if runtime.is_initialized():
        rt = runtime.current()
        return rt.generation, rt.size
    return 0, 1


def new_token(path: str) -> str:
    """A random id, the same on every rank (collective), for saves into ``path``: raises on
    every rank, before anything is written, if the ranks gave different paths."""
    size = world()[1]
    mine = (uuid.uuid4().hex, path)
    if size == 1:
        return mine[0]
    from ringtrain.collectives.objects import allgather_object

    every = allgather_object(mine)
    paths = [p for _, p in every]
    if len(set(paths)) > 1:
        raise CheckpointError(
            "a checkpoint is saved into one directory by every rank together, but the ranks "
            "gave different paths:\n"
            + "\n".join(by_rank([repr(p) for p in paths]))
            + "\nHINT: give every rank the same path (not one built from its rank); ringtrain "
            "writes each rank's part into it. Nothing was written."
        )
    return str(every[0][0])


def _all_ok(error: BaseException | None, size: int, what: str) -> None:
    """Raise on every rank if any rank failed: a failed rank its own error, the others the
    same kind of error naming it."""
    if size > 1:
        from ringtrain.collectives.objects import allgather_object

        told = None if error is None else (isinstance(error, SecurityError), str(error))
        errors = allgather_object(told)
    else:
        errors = [None if error is None else (False, "")]
    if error is not None:
        raise error
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, (secure, message) = bad[0]
        kind = SecurityError if secure else CheckpointError
        raise kind(f"{what} failed on rank {r}: {message}")


def prepare(
    path: str,
    step: int,
    keep: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    sampler: object,
    extra: object,
    host: Callable[[torch.Tensor, str], object] | None = None,
    save_id: str | None = None,
    run: str | None = None,
) -> tuple[store.Job, list[Item], sealed.Keys | None]:
    """The blocking half of a save: agree on an id (a collective, unless ``save_id`` is given,
    the same on every rank), copy this rank's part to host memory. What is left (writing,
    committing) needs no collective."""
    rank, size, config = _where()
    if save_id is None:
        save_id = new_token(path)
    final = os.path.abspath(path)
    parent, base = os.path.split(final)
    job = store.Job(
        final=final,
        partial=os.path.join(parent, f".{base}.partial-{save_id}"),
        save_id=save_id,
        rank=rank,
        size=size,
        step=int(step),
        keep=int(keep),
        timeout_s=float(config.timeout_s),
        facts={},
        run=run,
    )
    items, facts = parts.snapshot(rank, size, model, optimizer, sampler, extra, host)
    job.facts = facts
    return job, items, sealed.job_keys(config)


def save(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: object = None,
    extra: object = None,
    step: int = 0,
    keep: int = 0,
) -> str:
    """Save a checkpoint into the directory ``path`` (collective); returns its path.

    Every rank writes its own part: its share of the model's tensors (whole tensors, dealt by
    size), its ZeRO-1 shard of the optimizer state (or its share of the whole state), its RNG
    state, its sampler position and its compressor state; with local updates (``sync_every``)
    also its own weights, inner optimizer state and error feedback, beside the shared anchor and
    outer optimizer state (docs/checkpoint.md). ``extra`` (any picklable object, the
    same on every rank) is stored once. The checkpoint exists once its manifest is committed;
    an interrupted save leaves earlier checkpoints as they were. ``keep`` > 0 keeps only the
    newest ``keep`` ``step-N`` checkpoints beside ``path``.
    """
    job, items, keys = prepare(os.fspath(path), step, keep, model, optimizer, sampler, extra)
    error: BaseException | None = None
    try:
        store.write_part(job, items, keys)
    except Exception as e:  # any rank's failure is every rank's: the others wait for its word
        error = _named(e, job.final)
    _all_ok(error, job.size, f"writing the checkpoint {job.final}")
    if job.rank == 0:
        try:
            store.commit(job, keys)
        except Exception as e:
            error = _named(e, job.final)
    _all_ok(error if job.rank == 0 else None, job.size, f"committing the checkpoint {job.final}")
    return job.final


def _named(e: BaseException, where: str) -> BaseException:
    """OS errors become a :class:`CheckpointError` that names the checkpoint."""
    if isinstance(e, RingtrainError):
        return e
    hint = (
        "check the directory's space and permissions"
        if isinstance(e, OSError)
        else f"its cause, a {type(e).__name__}, is shown above"
    )
    err = CheckpointError(
        f"could not write the checkpoint {where}: {e}.\nHINT: {hint}; earlier checkpoints "
        "are untouched."
    )
    err.__cause__ = e
    return err


def load(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: object = None,
    strict: bool = True,
) -> Restored:
    """Load a checkpoint saved at any world size into these objects (collective).

    ``path`` is a checkpoint directory, or a directory of ``step-N`` checkpoints (the newest
    complete one is taken). The whole checkpoint is verified (manifest, every file's SHA-256,
    hashed once per host by its ranks together; sealed: authenticated) and checked against
    ``model`` and ``optimizer`` before anything is changed: on an error nothing was loaded.
    An unsealed file is read an item at a time, never held whole. The optimizer state is
    handed over whole and the optimizer keeps its own shard (sharded or not, any world size).
    The RNG states are restored per rank (rank r takes saved rank r mod N's). Compressor
    state (PowerSGD/top-k error feedback) is restored at the same world size and reset at
    another; ``auto``'s decision is kept at any size. A local-update optimizer (``sync_every``)
    continues bit for bit at the same world size; at another every rank starts a new round from
    the anchor (rank 0 logs what was reset; :mod:`ringtrain.checkpoint.local_state`).
    """
    rank, size, config = _where()
    keys = sealed.job_keys(config)
    what = f"loading the checkpoint {os.fspath(path)}"
    # First every file is verified (the ranks of a host share the hashing) and every rank
    # hears the outcome; only then is anything read from the files.
    opened = _attempt(
        lambda: store.open_checkpoint(os.fspath(path), keys, _host_share()), size, what
    )
    prepared = _attempt(lambda: _read(opened, model, optimizer, strict, rank, size), size, what)
    return _apply(prepared, model, optimizer, sampler, strict, rank, size)


def _attempt(fn: Callable[[], T], size: int, what: str) -> T:
    """``fn()`` on every rank, raised on every rank if it failed on any (collective)."""
    error: BaseException | None = None
    out: T | None = None
    try:
        out = fn()
    except Exception as e:  # any rank's failure is every rank's: the others wait for its word
        error = e
        if not isinstance(e, RingtrainError):
            error = CheckpointError(f"{what}: {type(e).__name__}: {e}")
            error.__cause__ = e
    _all_ok(error, size, what)
    assert out is not None  # _all_ok raised otherwise
    return out


def _host_share() -> tuple[int, int]:
    """This rank's place among its host's ranks: which of the checkpoint's files it hashes."""
    from ringtrain.runtime import state as runtime

    if runtime.is_initialized():
        rt = runtime.current()
        return rt.local_rank, rt.local_size
    return 0, 1


@dataclass
class _Prepared:
    opened: store.Opened
    asm: parts.Assembled
    local: local_state.LoadPlan | None = None  # a local-update checkpoint's, for the optimizer


def _read(
    opened: store.Opened,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    rank: int,
    size: int,
) -> _Prepared:
    asm = parts.assemble(opened.metadata, store.reader(opened), opened.directory)
    where = opened.directory
    if model is not None:
        _check_model(asm, model, strict, where)
    if optimizer is not None:
        meta = asm.objects.get("meta.optim")
        if meta is None:
            raise CheckpointError(f"{where} holds no optimizer.\nHINT: load without optimizer=.")
        kind = optimizer_state.kind_of(optimizer)
        if meta.get("kind", kind) != kind:
            raise CheckpointError(
                f"{where} holds the state of a {meta['kind']}, and this optimizer is a {kind}: "
                "its state and hyperparameters would not fit.\nHINT: build the optimizer as "
                "it was saved, or load only the model (without optimizer=) to change optimizers."
            )
        shapes = [tuple(p.shape) for p in optimizer_state.params_of(optimizer)]
        if [tuple(s) for s in meta["shapes"]] != shapes:
            raise CheckpointError(
                f"{where}: the optimizer's {len(shapes)} parameters do not match the "
                f"checkpoint's {len(meta['shapes'])} (number or shapes).\n"
                "HINT: build the model and optimizer as they were saved."
            )
        saved_comp = opened.manifest["layout"].get("compressor")
        mine = optimizer_state.compressor_name(optimizer)
        if saved_comp is not None and mine is not None and saved_comp != mine:
            raise CheckpointError(
                f"{where} was saved with compression {saved_comp!r}, this optimizer uses "
                f"{mine!r}.\nHINT: resume with the compression it was saved with."
            )
        if local_state.is_local(asm.objects):
            saved_size = int(opened.manifest["world_size"])
            local_state.check(asm.objects, optimizer, where, size == saved_size)
            plan = local_state.plan(asm.tensors, asm.objects, optimizer, rank, size, saved_size)
            return _Prepared(opened, asm, plan)
    return _Prepared(opened, asm)


def _check_model(asm: parts.Assembled, model: torch.nn.Module, strict: bool, where: str) -> None:
    """Refuse, before anything is loaded, a model the checkpoint's tensors do not fit: torch's
    ``load_state_dict`` copies the keys that match before it raises for those that do not."""
    meta = asm.objects.get("meta.model")
    if meta is None:
        raise CheckpointError(f"{where} holds no model.\nHINT: load without model=.")
    saved = {k[len("model.") :]: v for k, v in asm.tensors.items() if k.startswith("model.")}
    mine = model.state_dict()
    for k, v in mine.items():
        if isinstance(v, torch.Tensor) and k in saved and saved[k].shape != v.shape:
            raise CheckpointError(
                f"{where}: the model's {k} has shape {tuple(v.shape)}, the checkpoint's "
                f"{tuple(saved[k].shape)}.\nHINT: build the model as it was saved."
            )
    if not strict:
        return
    held = set(meta["keys"]) | set(meta["objects"])
    missing, unexpected = sorted(set(mine) - held), sorted(held - set(mine))
    if missing or unexpected:
        said = [f"the checkpoint lacks {_some(missing)}"] if missing else []
        said += [f"the model lacks {_some(unexpected)}"] if unexpected else []
        raise CheckpointError(
            f"{where} does not fit the model: {'; '.join(said)}. Nothing was loaded.\n"
            "HINT: build the model as it was saved, or load with strict=False to take the "
            "entries both have."
        )


def _some(keys: list[str]) -> str:
    shown = ", ".join(keys[:5])
    return f"{len(keys)} entries ({shown}{', ...' if len(keys) > 5 else ''})"


def _apply(
    prep: _Prepared,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    sampler: object,
    strict: bool,
    rank: int,
    size: int,
) -> Restored:
    asm, man = prep.asm, prep.opened.manifest
    saved_size = int(man["world_size"])
    if model is not None:
        meta = asm.objects["meta.model"]
        sd = dict(meta["objects"])
        for k in meta["keys"]:
            if f"model.{k}" in asm.tensors:
                sd[k] = asm.tensors[f"model.{k}"]
        model.load_state_dict(sd, strict=strict)
    if optimizer is not None and prep.local is not None:
        compressor = _compressor(asm, rank, size, saved_size)
        local_state.apply(prep.local, asm.objects, asm.tensors, model, optimizer, compressor, rank)
    elif optimizer is not None:
        meta = asm.objects["meta.optim"]
        state: dict[int, dict[str, object]] = {}
        for fqn, t in asm.tensors.items():
            if fqn.startswith("optim."):
                _, i, key = fqn.split(".", 2)
                state.setdefault(int(i), {})[key] = t.view(meta["shapes"][int(i)])
        for fqn, v in asm.objects.items():
            if fqn.startswith("optim_scalar."):
                _, i, key = fqn.split(".", 2)
                state.setdefault(int(i), {})[key] = v
        optimizer_state.load(
            optimizer, state, meta["param_groups"], _compressor(asm, rank, size, saved_size)
        )
    rng = asm.objects.get(f"rank{rank % saved_size}.rng")
    if rng is not None:
        parts.set_rng_state(rng)
    data = None
    states = [asm.objects.get(f"rank{r}.sampler") for r in range(saved_size)]
    if sampler is not None:
        if any(s is None for s in states):
            raise ConfigError(
                f"{prep.opened.directory} holds no sampler position.\nHINT: load without sampler=."
            )
        data = samplers.restore(sampler, [s for s in states if s is not None], rank, size)
    return Restored(
        prep.opened.directory,
        int(man["step"]),
        saved_size,
        asm.objects.get("meta.extra"),
        data,
        man,
    )


def _compressor(
    asm: parts.Assembled, rank: int, size: int, saved_size: int
) -> dict[str, object] | None:
    """Same world size: each rank its own compressor state. Another: reset, but ``auto`` keeps
    its decision (its inner compressor's state is reset)."""
    if size == saved_size:
        return asm.objects.get(f"rank{rank}.compressor")
    first = asm.objects.get("rank0.compressor")
    if first is None:
        return None
    state = first.get("state", {})
    if "choice" in state:  # auto: keep the decision
        return {"name": first["name"], "state": {**state, "inner": {}}}
    return None


def latest(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint under ``root`` (or ``root`` itself), or None."""
    try:
        return manifest.resolve(os.fspath(root))
    except CheckpointError:
        return None
