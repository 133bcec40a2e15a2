"""``ringtrain doctor``: a pre-flight check of a job's hosts, links and placement.

    command     the CLI subcommand: flags -> DoctorOptions -> examine -> report
    checkup     the sequence of checks; returns the --json document
    gather      I/O: the probe on every host (locally or over ssh), link tests, allreduce job
    linktest    the TCP latency/bandwidth test that the probe runs on the hosts
    wire        how the probe's results come back (marked JSON lines)
    findings    pure: problems and warnings from facts and link samples
    placement   pure: ranks per host, unevenness and its cost
    advice      pure: step-time prediction and recommended settings
    report      pure: the human-readable tables

Nothing here imports torch (an import contract keeps it so): torch facts come from
``python -m ringtrain.doctor.probe`` run on each host.
"""
