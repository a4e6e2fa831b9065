"""A follower rank of a multi-process replica (parallel.py): `python -m replicadp_tasks.follower`, started by the
replica's pool child (rank 0) with this rank's place in the environment.

It loads the same pipeline as rank 0 (the same settings: the same environment), joins the group, then runs every
request rank 0 hands it on stdin, one JSON line each, and throws the frames away: rank 0 encodes and stores. It
exits when its stdin closes (rank 0 ended it), when rank 0 dies (PDEATHSIG), and on any error (rank 0 sees it
exit and ends the replica's attempt: parallel.GroupLost)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> int:
    from . import parallel

    # 1. Die with rank 0, also when it is SIGKILLed; and if it died before this line, now.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ[parallel.PARENT_ENV]):
        return 1
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/follower] %(message)s")
    rank = int(os.environ[parallel.RANK_ENV])
    # 2. The same pipeline as rank 0, in the group.
    from .pipeline import PipelineHolder
    from .settings import SETTINGS

    holder = PipelineHolder.from_settings(SETTINGS, rank=rank, port=int(os.environ[parallel.PORT_ENV]))
    holder.load()
    logging.getLogger("replicadp").info("rank %d of %s loaded %r", rank, SETTINGS.parallel, SETTINGS.model)
    # 3. Each request rank 0 hands over, until it closes stdin.
    for line in sys.stdin:
        req, image = parallel.decode_work(line)
        try:
            holder.generate(req, image)
        except parallel.Stopped:
            continue
    return 0


if __name__ == "__main__":
    sys.exit(main())
