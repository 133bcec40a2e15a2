"""The rank side of ``ringtrain.run`` (:mod:`ringtrain.launch.python_run`): call the function
that came in the command line, print its return value on one marked stdout line.

    python -m ringtrain.launch.run_func PAYLOAD

An exception in the function ends the rank as an uncaught exception does in any script: the
launcher reports it and ``ringtrain.run`` raises.
"""

from __future__ import annotations

import base64
import sys

import cloudpickle

from ringtrain.launch import code_files
from ringtrain.launch.rank_output import RESULT_PREFIX


def main(argv: list[str] | None = None) -> int:
    (payload,) = sys.argv[1:] if argv is None else argv
    func, args, kwargs, *files = cloudpickle.loads(base64.b64decode(payload))
    code_files.restore(func, files[0] if files else {})  # tracebacks name the user's file
    result = func(*args, **kwargs)
    sys.stdout.flush()
    # A line of its own (a print() of the function ends its line; one without end does not).
    sys.stdout.write(RESULT_PREFIX + base64.b64encode(cloudpickle.dumps(result)).decode())
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
