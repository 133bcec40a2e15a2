"""``python -m ringtrain.bench ARGS`` is ``ringtrain bench ARGS``: the form to give a launcher.

ringtrain run -np 2 -H h0:1,h1:1 -- python -m ringtrain.bench train --model cnn
"""

import sys

from ringtrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
