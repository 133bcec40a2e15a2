"""Facts about the host this process runs on, and the rules built on them alone.

``network``: interfaces, their addresses and the rules that pick one; ``cpu_limits``: cgroup
CPU quotas, SMT siblings, usable cores; ``connections``: the sockets and files a rank holds at N
ranks, computed from the groups the runtime makes; ``open_files``: the open-file limit that
needs, raised by the agent. Plain Python (no torch): the launcher, the per-host agent, the
runtime and the engine all read them, so they sit below all four.
"""
