"""Two ranks that stop beating without being stopped (tests/launch/test_silent_ranks.py).

Rank 0 works for about 7 s of CPU time inside one C call that holds the GIL (``sum`` over a
range), so its heartbeat thread cannot run: silent but busy, it must live. Then, after a barrier
(so that on a loaded host, where those 7 s of CPU take far longer, rank 1 is not killed and the
job stopped before rank 0 has shown it lives), rank 1 sleeps inside a C call that holds the GIL
(libc ``sleep`` through ``ctypes.PyDLL``): silent and using no CPU, as a rank stuck in a driver
would be, it must be killed as frozen.
"""

from __future__ import annotations

import ctypes
import sys
import time

import ringtrain as rt

rt.init()
if rt.rank() == 0:
    # Calibrated on CPU time: wall time on a loaded host would count waits for a core and make
    # the long call too short.
    t = time.thread_time()
    sum(range(10**6))
    per_item = (time.thread_time() - t) / 10**6
    t = time.monotonic()
    sum(range(int(7.0 / per_item)))  # one call: the GIL is not let go until it returns
    print(f"rank 0 held the GIL for {time.monotonic() - t:.1f} s and lives", flush=True)
    rt.barrier()
    time.sleep(300)  # until the launcher stops the job for rank 1
else:
    rt.barrier()  # waiting here lets the heartbeat thread run: not silent
    ctypes.PyDLL(None).sleep(300)
    sys.exit("rank 1 was not killed")
