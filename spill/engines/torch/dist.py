"""torch.distributed as spill's process groups use it (``spill.jobs.group``), and torch's elastic
launcher (``spill.jobs.launch``): the only place either is imported.

Whatever engine computes, the ranks exchange float32 numpy through host memory over gloo, so a
group of MLX processes (torch is a core dependency) and a CUDA one go the same way.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import uuid
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

TIMES_OUT = True  # gloo gives up on a silent peer after join's timeout


def join(timeout_s: float) -> tuple[int, int]:
    """Join the group torchrun's environment describes (``RANK``, ``WORLD_SIZE``, ...); returns
    ``(rank, world)``."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def share(payload):
    """Rank 0's picklable ``payload`` on every rank."""
    box = [payload]
    dist.broadcast_object_list(box, 0)
    return box[0]


def any_of(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank."""
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return bool(t.item())


def gather_rows(meta: np.ndarray, rows: np.ndarray, world: int, device: str = "cpu"):
    """Every rank's ``meta`` (float64) and ``rows`` (float32), equal shapes on every rank;
    ``device``: where the job computes (host memory whatever it is)."""
    m, r = torch.from_numpy(meta), torch.from_numpy(rows)
    metas = [torch.empty_like(m) for _ in range(world)]
    all_rows = [torch.empty_like(r) for _ in range(world)]
    dist.all_gather(metas, m)
    dist.all_gather(all_rows, r)
    return [x.numpy() for x in metas], [x.numpy() for x in all_rows]


def collect(value, world: int) -> list:
    """Every rank's picklable ``value``, by rank."""
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(procs: int, argv: Sequence[str]) -> list[int] | None:
    """``python -m spill *argv`` as ``procs`` ranks on this host through torch's elastic
    launcher (what ``torchrun --standalone`` runs). Returns None when every rank finished, else
    the failed ranks' exit codes (a signal death negative); raises ``KeyboardInterrupt``-like
    ``Stopped`` when the launcher itself was signalled."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.root.manager.loggerDict):  # its lines are not ours to print
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=procs,
        run_id=f"spill-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.2,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "spill", *argv)
    except ChildFailedError as e:
        return [f.exitcode for f in e.failures.values()]
    except SignalException as e:
        raise Stopped(str(e)) from None
    return None


class Stopped(Exception):  # noqa: N818 - the launcher was signalled, as KeyboardInterrupt
    """The launcher received a stop signal and handed it to the ranks."""
