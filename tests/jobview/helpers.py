"""What the job-view tests share: reports and rank views built in one line."""

from __future__ import annotations

from sidecar.jobview.report import NodeReport, RankView


def rank(
    r: int, state: str = "suspect", step: int | None = 29, waiting: bool | None = True, age: float = 3.0,
    exited_at: float | None = None, local: int = 0,
) -> RankView:  # fmt: skip
    top = "all_reduce (distributed/distributed_c10d.py:2505)" if waiting else "train_step (train.py:14)"
    return RankView(r, local, state, step, None, age, waiting, top if waiting is not None else None, exited_at)


def report(node: str, *ranks: RankView, job: str = "j1", world: int = 4, **kw) -> NodeReport:
    return NodeReport(job_id=job, node=node, world_size=world, time=1.0, ranks=list(ranks), **kw)
