"""Benchmarks as registered functions that return results; ``ringtrain bench`` presents them.

* ``allreduce`` (:mod:`.allreduce`): bus bandwidth vs message size, ringtrain vs raw
  torch.distributed in the same run, and the cost of many small tensors (fusion).
* ``cpu`` (:mod:`.cpu`): CPU time per allreduce per rank (all threads, idle tail included),
  ringtrain vs raw torch.distributed in the same run, and a burst of async ops.
* ``train`` (:mod:`.train`): steps/s of ringtrain's DistributedOptimizer, torch DDP and a
  no-communication reference, interleaved, on model presets (:mod:`.models`) of 1M-100M params.
* ``secure`` (:mod:`.secure`): what secure mode costs, allreduce bus bandwidth of raw Gloo,
  ringtrain plain and ringtrain secure in alternating phases of the same processes.
* ``checks`` (:mod:`.checks`): what consistency checks (mismatch detection) cost, allreduce
  time with them on vs off in alternating phases, and the check alone.
* ``mixed-speed`` (:mod:`.mixed_speed`): one rank slowed (a CPU hog or sleeping), samples/s
  with equal shares of the global batch vs ``batch_shares="auto"`` vs the sum of alone-speeds.

Each benchmark runs on every rank between ``ringtrain.init()`` and ``ringtrain.shutdown()``;
:mod:`.ranks` spawns local ranks or runs in place under a launcher. Nothing is imported here, so
``import ringtrain.bench`` stays cheap; import the submodules (or use the CLI).
"""
