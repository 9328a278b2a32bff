"""A torchrun worker that shows what a restarted attempt finds in the agent's store.

Attempt 0 forms a gloo group and rank 1 exits with an error (torchrun restarts the group).
Attempt 1 looks, before forming its own group, for the address keys gloo wrote in attempt 0,
then forms its group. Each rank writes what it saw to OUT_DIR/attempt<a>-rank<r>.json, again
(with `formed`) once its group works.
USE_HELPER=1 forms the group through trainer_hooks.distributed; the test runs USE_HELPER=0 with
SIDECAR_ATTEMPT_STORE=0, since importing trainer_hooks installs the remedy by itself."""

import json
import os
import sys

import torch.distributed as dist

import trainer_hooks.distributed

GLOO_KEYS = [f"default_pg/0//cpu//0/{r}" for r in range(int(os.environ["WORLD_SIZE"]))]
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
stale = [k for k in GLOO_KEYS if agent_store.check([k])]


def write(**fields) -> None:
    path = os.path.join(os.environ["OUT_DIR"], f"attempt{attempt}-rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"attempt": attempt, "rank": rank, **fields}, f)
    os.replace(path + ".tmp", path)  # readers never see half a file


write(stale_before_init=stale)
if os.environ.get("USE_HELPER") == "1":
    generation = trainer_hooks.distributed.init_process_group("gloo")
else:
    dist.init_process_group("gloo")
    generation = None
dist.barrier()
if attempt == 0 and rank == 1:
    sys.exit(1)
if attempt == 0:
    dist.barrier()  # fails once rank 1 is gone; torchrun restarts the group
write(stale_before_init=stale, generation=generation, formed=True)
dist.destroy_process_group()
