"""Helpers for the multi-process tests (test_parallel_*.py): gloo process groups on 127.0.0.1 only."""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, out_dir: str, timeout_s: float, args: tuple) -> None:
    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, Path(out_dir), *args)
        torch.save(result, Path(out_dir) / f"result_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, out_dir: Path, *args, timeout_s: float = 120.0) -> list:
    """Run ``fn(rank, world, out_dir, *args)`` on ``world`` gloo ranks; return each rank's return value.

    A failure on any rank raises in the caller with that rank's traceback (``torch.multiprocessing``). The ranks are
    forked, not spawned: a spawned child re-imports torch (~5-15 s on a busy 2-core machine, per rank), a forked
    one starts in milliseconds. Forking is safe here because each child uses one intra-op thread and no process
    group exists in the parent.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_entry, args=(fn, world, free_port(), str(out_dir), timeout_s, args), nprocs=world,
                       join=True, start_method="fork")
    return [torch.load(out_dir / f"result_rank{r}.pt", weights_only=False) for r in range(world)]


def ep_mesh(ep: int, timeout_s: float = 60.0):
    """This rank's expert-parallel view (:class:`moetrain.parallel.layout.ParallelMesh`) of the engine's mesh with
    ``ep`` ranks per EP group and the rest of the world as replicas (a collective: every rank calls it)."""
    from moetrain.parallel.config import ParallelConfig
    from moetrain.parallel.layout import Layout, build_layout_mesh

    layout = Layout.from_config(ParallelConfig(ep=ep), dist.get_world_size())
    return build_layout_mesh(layout, timeout_s, torch.device("cpu")).ep_mesh
