"""Your own training script, as it is before the sidecar: DDP over gloo on the CPU, nothing of
`trainer_hooks` imported. README.md, "Your own script in three commands", runs it unchanged under
`python -m trainer_hooks.launch ... -m trainer_hooks.attach examples/own_script.py`, which
registers each rank with the node's sidecar and reports every optimizer step
(tests/ops/test_readme_own_script.py runs those commands as an unprivileged user).
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def train(steps: int, lr: float) -> float:
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for step in range(1, steps + 1):
        x = torch.randn(32, 16, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        if rank == 0 and step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    return loss.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # rank, world size and the store's address from torchrun's environment
    loss = train(args.steps, args.lr)
    print(f"rank {dist.get_rank()}: trained {args.steps} steps, final loss {loss:.4f}", flush=True)
    # Every rank done, then the group closed while the interpreter is whole (the model went with
    # train()'s frame): with torch 2.13 a gloo group torn down at exit may abort or hang.
    dist.barrier()
    dist.destroy_process_group()
