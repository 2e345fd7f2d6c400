"""``mx.distributed`` as spill's process groups use it (``spill.jobs.group``) when ``mlx.launch``
started the ranks: the same collectives as ``spill.engines.torch.dist``, on MLX's own backends.

``join`` returns ``(rank, world)``; ``share``, ``any_of``, ``gather_rows`` and ``collect`` move
picklable objects and arrays between ranks. On the ring (TCP) a peer that dies fails the collective
at once (``[ring] connection to a peer was lost``, a ``RuntimeError``); one that stops answering is
never noticed, so ``spill.jobs.group`` bounds each collective with its own watchdog (``TIMES_OUT``).
"""

from __future__ import annotations

import json
import os
import pickle

import mlx.core as mx
import numpy as np

TIMES_OUT = False  # a hung peer hangs a collective: the group's watchdog bounds it
_group: mx.distributed.Group | None = None
_stream = mx.cpu  # the ring and jaccl exchange host memory; nccl (CUDA) the GPU's


# mlx.launch tells a rank who it is in its environment: ``MLX_RANK`` always, and per backend where
# the others are (ring: ``MLX_HOSTFILE``, a JSON list of each rank's ``ip:port``, empty for one
# process; nccl: ``MLX_WORLD_SIZE``; jaccl: ``MLX_JACCL_COORDINATOR``).
def _backend() -> str:
    if os.environ.get("MLX_HOSTFILE") is not None:
        return "ring"
    if os.environ.get("MLX_JACCL_COORDINATOR"):
        return "jaccl"
    if os.environ.get("MLX_WORLD_SIZE"):
        return "nccl"
    return "any"


def _ring_size() -> int:
    text = open(os.environ["MLX_HOSTFILE"]).read().strip()  # noqa: SIM115 - a tiny temp file
    return len(json.loads(text)) if text else 1


def join(timeout_s: float) -> tuple[int, int]:
    """Join the group mlx.launch started (``timeout_s``: the watchdog's, not MLX's); returns
    ``(rank, world)``. One process (``mlx.launch -n 1``) joins nothing."""
    global _group, _stream
    backend = _backend()
    if backend == "ring" and _ring_size() == 1:
        return 0, 1
    _group = mx.distributed.init(strict=True, backend=backend)
    if backend == "nccl":
        _stream = mx.gpu
    return _group.rank(), _group.size()


def _run(x: mx.array) -> np.ndarray:
    mx.eval(x)
    return np.array(x)


# Objects travel pickled in uint8 arrays; ``all_gather`` wants one shape on every rank, so lengths
# go first and the bytes are padded to the longest.
def _gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's ``data``, by rank."""
    n = np.array([len(data)], dtype=np.int64)
    sizes = _run(mx.distributed.all_gather(mx.array(n), stream=_stream)).tolist()
    box = np.zeros(max(max(sizes), 1), dtype=np.uint8)
    box[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    rows = _run(mx.distributed.all_gather(mx.array(box), stream=_stream)).reshape(len(sizes), -1)
    return [rows[r, :k].tobytes() for r, k in enumerate(sizes)]


def share(payload):
    """Rank 0's picklable ``payload`` on every rank (the others' is None): one sum of rank 0's
    bytes and everyone else's zeros, each rank receiving the payload's size, not the world's."""
    data = pickle.dumps(payload) if _group.rank() == 0 else b""
    n = _run(mx.distributed.all_max(mx.array([len(data)], dtype=mx.int64), stream=_stream))
    box = np.zeros(max(int(n[0]), 1), dtype=np.uint8)
    box[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    got = _run(mx.distributed.all_sum(mx.array(box), stream=_stream))
    return pickle.loads(got[: int(n[0])].tobytes())


def any_of(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank."""
    got = _run(mx.distributed.all_max(mx.array([int(flag)], dtype=mx.int32), stream=_stream))
    return bool(got[0])


def gather_rows(meta: np.ndarray, rows: np.ndarray, world: int, device: str = "cpu"):
    """Every rank's ``meta`` (float64) and ``rows`` (float32), equal shapes on every rank,
    copied bit for bit (``device`` is the torch backend's concern)."""
    metas = _run(mx.distributed.all_gather(mx.array(meta.view(np.uint8)), stream=_stream))
    all_rows = _run(mx.distributed.all_gather(mx.array(rows), stream=_stream))
    metas = metas.reshape(world, *meta.shape[:-1], -1).view(np.float64)  # (world, slots, 3)
    return list(metas), list(all_rows.reshape(world, *rows.shape))


def collect(value, world: int) -> list:
    """Every rank's picklable ``value``, by rank."""
    got = _gather_bytes(pickle.dumps(value))
    assert len(got) == world
    return [pickle.loads(b) for b in got]


def leave() -> None:
    """mx.distributed has no teardown: the sockets close with the process."""
