"""Process groups of abandoned worlds: unregistered from torch.distributed, never destroyed.

A group whose peer vanished blocks whoever destroys it (or drops its last reference) until its
op in flight times out; an elastic rank leaves such worlds without waiting (``state.abandon``,
or a start whose world was replaced while it made its groups).
"""

from __future__ import annotations

import torch.distributed as dist

# Groups of abandoned worlds: destroying one with an op stuck in it blocks until that op's
# timeout, and so would dropping the last reference; they are kept for the process's lifetime.
_groups: list[object] = []


def keep_past_exit(obj: object) -> None:
    """Hold ``obj`` with a reference the interpreter never drops, not even while it clears the
    modules at exit: a group still waiting on a silent peer (a cut link) would otherwise block
    the process's exit in its destructor until the transport timeout."""
    import ctypes

    # HACK: a deliberate leak; the OS frees the group when the process exits.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def forget_all() -> None:
    """Unregister every process group from torch.distributed, keeping each alive, unstopped."""
    c10d = dist.distributed_c10d
    world = c10d._world
    for group in world.pg_map:
        _groups.append(group)
        keep_past_exit(group)
        leave = getattr(group, "leave", None)  # ringtrain's own groups stop without waiting
        if callable(leave):
            leave()
    # HACK: destroy_process_group() minus the shutdown of each group (which blocks on a
    # group whose peer vanished): torch has no public call to drop its registry only.
    c10d._update_default_pg(None)
    for table in (
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.tags_to_pg,
        world.pg_coalesce_state,
    ):
        table.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
