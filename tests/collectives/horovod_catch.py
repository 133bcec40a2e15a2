# A Horovod user's script: catch the error of a mismatched collective on every rank and go on.
# The test swaps only the import line.
import horovod.torch as hvd
import torch

hvd.init()
r = hvd.rank()
try:
    hvd.allreduce(torch.ones(2 + r), name="data.dependent.shape")
except RuntimeError as e:
    internal = isinstance(e, hvd.HorovodInternalError)
    print(f"caught {type(e).__name__} internal={internal}", flush=True)
out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after")
print(f"after {out.tolist()}", flush=True)
last = hvd.add_process_set([hvd.size() - 1])
if last.included():  # root_rank is a global rank, also on a process set
    print(f"set broadcast {hvd.broadcast(torch.tensor([r]), r, process_set=last).item()}")
hvd.shutdown()
