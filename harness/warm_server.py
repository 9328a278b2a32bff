"""`python -m harness.warm_server SOCKET KIND`: one of the suite's warm servers (harness/zygote.py).
It imports what its KIND needs once and forks a child per request that becomes the process asked
for; a torchrun agent's child also serves its workers warm (harness/zygote_ranks.py)."""

from __future__ import annotations

import os
import runpy
import sys

from harness import zygote, zygote_ranks


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[2] not in zygote.KINDS:
        raise SystemExit(f"usage: python -m harness.warm_server SOCKET {{{'|'.join(zygote.KINDS)}}}")
    path, module = sys.argv[1], sys.argv[2]
    # returns only in a child
    request = zygote.serve(path, zygote.KINDS[module].preload, lambda r: zygote.refusal(r, module))
    sys.modules.pop(module, None)  # run as __main__, as `python -m` does (runpy warns otherwise)
    zygote.become(request)
    if module == "torch.distributed.run":
        zygote_ranks.install(os.path.dirname(path))
    runpy.run_module(request["argv"][2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
