"""An elastic job whose optimizer state lives in shards (``shard_optimizer=True``, Adam).

2 ranks; rank 1 SIGKILLs itself after the commit of batch 4, while rank 0 is in the step of
batch 5. Each rank prints a digest of the whole optimizer state at every commit and in the reset
callback: after the reset the survivor must hold the state of its last commit.
"""

from __future__ import annotations

import hashlib
import os
import signal

import torch

import ringtrain.torch as hvd
from ringtrain.runtime import membership


def main() -> None:
    hvd.init()
    me = membership.identity()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        shard_optimizer=True,
    )
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)

    def digest() -> str:
        held = opt.state_dict()["state"]
        parts = [repr(sorted(held)).encode()]
        for i in sorted(held):
            for key in sorted(held[i]):
                parts.append(torch.as_tensor(held[i][key]).numpy().tobytes())
        return hashlib.sha256(b"".join(parts)).hexdigest()[:16]

    state.register_reset_callbacks(
        [lambda: print(f"reset id={me} batch={state.batch} opt={digest()}", flush=True)]
    )

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.batch < 6:
            if me == 1 and state.batch == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            model(torch.ones(4, 2)).pow(2).mean().backward()
            opt.step()
            state.batch += 1
            if state.batch % 2 == 0:
                state.commit()
                print(f"commit id={me} batch={state.batch} opt={digest()}", flush=True)

    train(state)
    print(f"done id={me} batch={state.batch}", flush=True)


if __name__ == "__main__":
    main()
