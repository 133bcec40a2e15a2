"""``ringtrain run``: plan a job, start one agent per host, supervise the ranks, clean up.

    command      the CLI subcommand: flags -> LaunchOptions -> plan -> Supervisor
    options      LaunchOptions, the one typed object the flags map onto
    hosts        -H / --hostfile parsing
    plan         pure: (options, hosts) -> [ProcessSpec]
    rank_env     the variables every rank gets (RINGTRAIN_*, HOROVOD_*, forwarded ones)
    tuning       CPU binding, OMP threads, allocator preload (pure, from host facts)
    network      interface discovery and choice
    agent_start  how an agent is started: a local subprocess or ssh
    protocol     the JSON-lines messages between launcher and agent
    agent        the per-host process that starts, streams and stops that host's ranks
    leftovers    what an exited rank left running (its session, its orphans), ended by the agent
    supervisor   the launcher side: agents up, ranks started, the first failure, Ctrl-C
    job_state    the job's one state (starting ... done) and pure decisions on events
    exit_policy  what one rank's exit means (pure)
    agent_link   one host's agent as the supervisor sees it: process, messages, error tail
    job_network  the job's interface choice from the agents' reports, checked before ranks start
    elastic_hosts  the elastic host pool the supervisor owns: re-formed worlds, offered hosts
    failures     how a rank's end is worded (code, signal, missed heartbeats); the final report
    rank_output  the ranks' lines relayed to the launcher's stdout/stderr and output files
    rendezvous   the job's store server, started as a child process

Nothing here imports torch: the launcher starts fast and runs on hosts without it.
"""
