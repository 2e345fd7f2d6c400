"""torch.distributed as spill's process groups use it (``spill.jobs.group``), and torch's elastic
launcher (``spill.jobs.launch``): the only place either is imported.

``join`` returns ``(rank, world)``; ``share``, ``any_of``, ``gather_rows`` and ``collect`` move data
between ranks, which exchange float32 numpy whatever engine computes: the gather is a copy and the
fold after it is in micro-batch order, so the bits do not depend on the world size or on the
backend. ``launch`` (``--procs``: one host) runs the ranks and listens on loopback only.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import uuid
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

TIMES_OUT = True  # gloo and NCCL give up on a silent peer after join's timeout
LOOPBACK = "127.0.0.1"
RDZV = "spill-loopback"  # the launcher's rendezvous: torch's c10d one, on loopback only
_gpu: torch.device | None = None  # this rank's own GPU, when it has one
_agreed: dict[str, bool] = {}  # a job's device -> whether every rank exchanges on its GPU


# A rank that has a GPU of its own (``LOCAL_RANK`` below the device count) makes it its current
# device at ``join`` (so ``cuda`` means ``cuda:LOCAL_RANK`` for the engine) and joins gloo for host
# memory and NCCL for CUDA tensors; when every rank of a job computes on its GPU (agreed once,
# ``_on_gpus``) the gradients cross over NCCL, on that GPU; otherwise, and for every object
# (pickled, small), gloo in host memory.
def join(timeout_s: float) -> tuple[int, int]:
    """Join the group torchrun's environment describes (``RANK``, ``WORLD_SIZE``, ...); returns
    ``(rank, world)``. Gloo, and NCCL beside it where this rank has a GPU of its own."""
    global _gpu
    local = int(os.environ.get("LOCAL_RANK") or 0)
    backend = "gloo"
    if torch.cuda.is_available() and local < torch.cuda.device_count():
        torch.cuda.set_device(local)
        _gpu, backend = torch.device("cuda", local), "cpu:gloo,cuda:nccl"
    timeout = datetime.timedelta(seconds=timeout_s)
    if (store := _attempt_store(timeout)) is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(timeout: datetime.timedelta):
    """torchrun's agent lends its workers its rendezvous store and keeps it across restarts
    (``TORCHELASTIC_USE_AGENT_STORE``): a group it restarts (``--max-restarts``) reads the keys
    of the group before it and connects to ranks that are gone (torch issue 135712). Under one
    agent (one node: ``GROUP_WORLD_SIZE`` 1) every rank has the same restart count, which names
    the attempt's own keys; with several nodes the counts may differ, and the store is left as
    torch makes it (docs/procs.md: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1":
        return None
    shared = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), timeout=timeout)
    return dist.PrefixStore(f"spill/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", shared)


def share(payload):
    """Rank 0's picklable ``payload`` on every rank."""
    box = [payload]
    dist.broadcast_object_list(box, 0, device=torch.device("cpu"))
    return box[0]


def any_of(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank."""
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return bool(t.item())


def _on_gpus(device: str) -> bool:
    """Whether a job computing on ``device`` exchanges on its GPUs over NCCL: every rank
    computes on its own GPU (asked of the ranks once per device, over gloo: a node without one
    sends everyone to host memory)."""
    if device not in _agreed:
        mine = _gpu is not None and device.partition(":")[0] == "cuda"  # not MLX's "gpu"
        mine = mine and torch.device(device).index in (None, _gpu.index)
        _agreed[device] = not any_of(not mine)
    return _agreed[device]


def gather_rows(meta: np.ndarray, rows: np.ndarray, world: int, device: str = "cpu"):
    """Every rank's ``meta`` (float64) and ``rows`` (float32), equal shapes on every rank;
    ``device``: where the job computes (``cuda`` on every rank: the exchange is NCCL's)."""
    on = _gpu if _on_gpus(device) else torch.device("cpu")
    m, r = torch.from_numpy(meta).to(on), torch.from_numpy(rows).to(on)
    metas = [torch.empty_like(m) for _ in range(world)]
    all_rows = [torch.empty_like(r) for _ in range(world)]
    dist.all_gather(metas, m)
    dist.all_gather(all_rows, r)
    return [x.cpu().numpy() for x in metas], [x.cpu().numpy() for x in all_rows]


def collect(value, world: int) -> list:
    """Every rank's picklable ``value``, by rank."""
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# torch's ``TCPStore`` binds every interface whatever host it is given, so the launcher's two stores
# (the rendezvous's and the one its ranks meet at) are made here on a socket already bound to
# 127.0.0.1 (``master_listen_fd``), through a rendezvous handler of spill's (``RDZV``: torch's c10d
# one, its stores made so), and the ranks' gloo and NCCL listeners are put on the loopback interface
# (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, unless the environment names another).
def launch(procs: int, argv: Sequence[str]) -> dict[int, int] | None:
    """``python -m spill *argv`` as ``procs`` ranks on this host through torch's elastic
    launcher (what ``torchrun --standalone`` runs). Returns None when every rank finished, else
    the failed ranks' exit codes (a signal death negative) by rank, in the order torch found
    them (those that ended before its teardown first); raises ``KeyboardInterrupt``-like
    ``Stopped`` when the launcher itself was signalled."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.root.manager.loggerDict):  # its lines are not ours to print
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the ranks' own listeners
        os.environ.setdefault(name, _loopback_interface())
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(RDZV, _loopback_rendezvous)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=procs,
        run_id=f"spill-{uuid.uuid4().hex[:12]}",
        rdzv_backend=RDZV,
        rdzv_endpoint=f"{LOOPBACK}:0",
        local_addr=LOOPBACK,  # the ranks' MASTER_ADDR (else this host's name)
        max_restarts=0,
        monitor_interval=0.2,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "spill", *argv)
    except ChildFailedError as e:
        return {rank: f.exitcode for rank, f in e.failures.items()}
    except SignalException as e:
        raise Stopped(str(e)) from None
    return None


def _loopback_store(port: int = 0) -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1 only: on a socket bound here, handed over."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(1024)
    port = sock.getsockname()[1]
    return dist.TCPStore(
        LOOPBACK, port, is_master=True, multi_tenant=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60), master_listen_fd=sock.detach(),
    )  # fmt: skip


def _loopback_rendezvous(params):
    """torch's c10d rendezvous (``dynamic_rendezvous``) over stores made by ``_loopback_store``:
    its own store, and the one it makes for the ranks (``_create_tcp_store_server``)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class Loopback(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
            return _loopback_store(master_port)

        def get_backend(self) -> str:  # what the registry checks it was asked for
            return RDZV

    store = _loopback_store()
    backend = C10dRendezvousBackend(store, params.run_id)
    return Loopback.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, LOOPBACK
    )


def _loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    with_loopback = [n for _, n in socket.if_nameindex() if n.startswith("lo")]
    return with_loopback[0] if with_loopback else "lo"


class Stopped(Exception):  # noqa: N818 - the launcher was signalled, as KeyboardInterrupt
    """The launcher received a stop signal and handed it to the ranks."""
