"""`python -m trainer_hooks.launch`: torchrun for any script, whose agent re-forms a multi-node job
faster after a restart (trainer_hooks/rendezvous.py: the rendezvous' one-second SYNC waits and its
`inspect.stack()` event names).

    python -m trainer_hooks.launch --nnodes 3 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint node-0:29400 --rdzv-id job-7 --max-restarts 3 train.py --lr 0.1

takes torchrun's command line unchanged: it is torchrun (`torch.distributed.run`: its agent,
rendezvous, restarts and workers, started as torchrun starts them), with the agent patched first.
Nothing changes in the workers. SIDECAR_RDZV_POLL_SECONDS sets the rendezvous wait (default 0.1;
1 is torch's own pace).
"""

from __future__ import annotations

import sys

from trainer_hooks import rendezvous


def main(argv: list[str] | None = None) -> None:
    import torch.distributed.run as torchrun

    rendezvous.install()
    torchrun.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
