"""One replica's pipeline holder, in a process of its own, under a layout (REPLICADP_PARALLEL and REPLICADP_MODEL
in the environment, as a replica reads them; the holder starts and ends its follower ranks): runs each request
given as JSON, writes its uint8 frames as FOLDER/<index>.npy, and prints as JSON how many times this rank (rank 0)
ran a first transformer block (either expert's) for each request. A request with "preempt_at": K is preempted at
step K on every rank, then resumed from its checkpoint (through its bytes): its frames are the resumed run's.
test_parallel compares the frames of several layouts with one process's.

    python tests/layout_frames.py FOLDER '[{request fields}, ...]'
"""

import json
import sys
from pathlib import Path

import numpy as np

from replicadp_tasks.contract import Accepts, RequestPreempted, validate_request
from replicadp_tasks.model import PipelineHolder
from replicadp_tasks.model.checkpoint import Checkpoint
from replicadp_tasks.model.pipeline import experts
from replicadp_tasks.settings import SETTINGS


def main(folder: str, requests: str) -> None:
    holder = PipelineHolder(SETTINGS.model_options())
    holder.load()
    calls = [0]
    for expert in experts(holder.pipe):
        expert.blocks[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    runs = []
    try:
        for i, fields in enumerate(json.loads(requests)):
            calls[0] = 0
            preempt_at = fields.pop("preempt_at", None)
            req = validate_request(fields, Accepts(size_multiple=holder.size_multiple, experts=holder.expert_count,
                                                   defaults=holder.request_defaults))
            resume = None if preempt_at is None else preempted(holder, req, preempt_at)
            np.save(Path(folder) / f"{i}.npy", holder.generate(req, resume=resume))
            runs.append(calls[0])
    finally:
        if holder.followers is not None:
            holder.followers.close()
    print(json.dumps({"block_calls": runs}))


def preempted(holder: PipelineHolder, req, step: int) -> Checkpoint:
    """`req` preempted at `step` on every rank: its checkpoint, through its bytes."""
    def stop(at: int, total: int) -> None:
        if at == step:
            raise RequestPreempted(f"at step {at} of {total}")
    try:
        holder.generate(req, on_step=stop)
    except RequestPreempted as exc:
        return Checkpoint.from_bytes(exc.checkpoint.to_bytes())
    raise AssertionError(f"not preempted at step {step}")


if __name__ == "__main__":
    main(*sys.argv[1:])
