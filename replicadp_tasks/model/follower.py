"""A follower rank of a multi-process replica (parallel.py): `python -m replicadp_tasks.model.follower`, started by the
replica's pool child (rank 0) with this rank's place and rank 0's model options in the environment.

It loads the same pipeline as rank 0 (rank 0's options, not settings of its own), joins the group, then runs every
request rank 0 hands it on stdin, one JSON line each (with the checkpoint it goes on from, if it was preempted), up
to the latents: rank 0 decodes, encodes and stores. It
exits when its stdin closes (rank 0 ended it), when rank 0 dies (PDEATHSIG), and on any error (rank 0 sees it
exit and ends the replica's attempt: parallel.GroupLost), after reporting an out of memory to rank 0, which fails
the request instead (parallel.Report)."""

from __future__ import annotations

import ctypes
import json
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
    # 2. The same pipeline as rank 0 (its options), in the group.
    from ..contract.errors import OutOfMemory
    from .options import ModelOptions
    from .pipeline import PipelineHolder

    options = ModelOptions.from_json(os.environ[parallel.OPTIONS_ENV])
    holder = PipelineHolder(options, rank=rank, store_path=os.environ[parallel.STORE_ENV])
    holder.load()
    logging.getLogger("replicadp").info("rank %d of %s loaded %r", rank, options.layout, options.spec)
    # 3. Each request rank 0 hands over, until it closes stdin. Out of memory here breaks the group as any error
    #    does, but fails the request instead of requeueing it (it would fail again): said to rank 0 before exiting.
    for line in sys.stdin:
        req, image, resume = parallel.decode_work(line)
        try:
            holder.generate(req, image, resume=resume)
        except parallel.Stopped:
            continue
        except OutOfMemory as exc:
            logging.getLogger("replicadp").error("rank %d: %s; exits", rank, exc)
            with os.fdopen(int(os.environ[parallel.REPORT_FD_ENV]), "w") as report:
                report.write(json.dumps(parallel.Report(out_of_memory=holder.group_broken)))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
