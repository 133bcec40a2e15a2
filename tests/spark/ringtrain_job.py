"""A plain ringtrain training script, run unchanged by Spark's TorchDistributor (which starts
torchrun in each Spark task). Every rank writes ``<argv[1]>/rank<N>.json``: its place in the job,
whether every rank ended with the same weights and whether training moved them."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for _training

import ringtrain.torch as hvd
from _training import tiny_job
from ringtrain.runtime import state

torch.set_num_threads(1)
hvd.init()
trained = tiny_job()
result = {
    "rank": hvd.rank(),
    "size": hvd.size(),
    "local_size": hvd.local_size(),
    "cross_size": hvd.cross_size(),
    "launcher": state.current().placement.launcher,
    **trained,
}
hvd.shutdown()
Path(sys.argv[1], f"rank{result['rank']}.json").write_text(json.dumps(result))
