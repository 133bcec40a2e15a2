"""``ringtrain run``: plan a job, start one agent per host, supervise the ranks, clean up.

    command      the CLI subcommand: flags -> LaunchOptions -> plan -> Supervisor
    options      LaunchOptions, the one typed object the flags map onto
    hosts        -H / --hostfile parsing
    plan         pure: (options, hosts) -> [ProcessSpec]
    rank_env     the variables every rank gets (RINGTRAIN_*, HOROVOD_*, forwarded ones)
    tuning       CPU binding, OMP threads, allocator preload (pure, from host facts)
    network      interface discovery and choice
    transport    how an agent is started: a local subprocess or ssh
    protocol     the JSON-lines messages between launcher and agent
    agent        the per-host process that starts, streams and stops that host's ranks
    supervisor   the launcher side: agents, output, the first failure, Ctrl-C
    rendezvous   the job's store server, started as a child process

Nothing here imports torch: the launcher starts fast and runs on hosts without it.
"""
