"""Per-rank I/O of a sharded checkpoint (the FSDP2 + pipeline engine on gloo ranks, through the ``Checkpointer``).

For each saving layout, 4 ranks save once, then 4 ranks load that checkpoint in each loading layout. Printed per
rank:

- save: wall time (from a barrier to the save's return), bytes this rank hashed (its own shard files, read back;
  rank 0 also ``.metadata``), and bytes it received from other ranks through object collectives (DCP's plans and
  metadata, the digests gathered by rank 0, the outcome), pickled;
- load: wall time of ``Checkpointer.latest`` + ``Checkpointer.load``, the shard files this rank verified and their
  bytes (everything ``latest`` reads besides, the manifest and the small files, is the same on every rank).

Usage: ``python benchmarks/checkpoint_io.py [--hidden 256] [--layers 4] [--experts 8] [--dir /tmp/ckpt-io]``.
Prints figures only; nothing is asserted (the per-rank promises are tested in tests/test_checkpoint_per_rank.py).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import pickle
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetrain.config import build_config
from moetrain.parallel.dcp import materialise_optimizer_state
from moetrain.parallel.engine import ShardedHooks
from moetrain.parallel.layout import Layout, build_layout_mesh
from moetrain.parallel.meta_init import build_meta
from moetrain.train import checkpoint
from moetrain.train.checkpointer import Checkpointer
from moetrain.train.schedule import build_scheduler
from moetrain.train.state import TrainState
from moetrain.train.trainer import build_optimizer

LAYOUTS = {"dp_shard2_ep2": {"dp_shard": 2, "ep": 2}, "pp2_ep2": {"pp": 2, "ep": 2}}
WORLD = 4


class Meter:
    """Bytes hashed (``checkpoint.stream_digest``) and object-collective bytes received, on this rank."""

    def __init__(self) -> None:
        self.hashed = self.received = 0
        self._saved: dict = {}

    def __enter__(self) -> "Meter":
        digest = self._saved["stream_digest"] = checkpoint.stream_digest

        def counted(stream, copy_to=None):
            out = digest(stream, copy_to)
            self.hashed += out["bytes"]
            return out
        checkpoint.stream_digest = counted
        rank = dist.get_rank()
        for name in ("gather_object", "broadcast_object_list", "scatter_object_list"):
            self._saved[name] = fn = getattr(dist, name)

            def received(*args, _fn=fn, _name=name, **kwargs):
                out = _fn(*args, **kwargs)
                a = inspect.signature(_fn).bind(*args, **kwargs).arguments
                if _name == "gather_object":
                    gathered = a.get("object_gather_list") or []
                    self.received += sum(len(pickle.dumps(o)) for i, o in enumerate(gathered) if i != rank)
                elif rank != (a.get("src") or 0):  # broadcast / scatter from rank 0: received elsewhere
                    first = "object_list" if _name == "broadcast_object_list" else "scatter_object_output_list"
                    self.received += len(pickle.dumps(a[first]))
                return out
            setattr(dist, name, received)
        return self

    def __exit__(self, *exc) -> None:
        checkpoint.stream_digest = self._saved.pop("stream_digest")
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _engine(parallel: dict, args: argparse.Namespace):
    moe = {"num_experts": args.experts, "top_k": 2, "experts": {"ffn_hidden": args.hidden},
           "losses": {"aux_loss_coeff": 0.0}}
    cfg = build_config("tiny", overrides={
        "model": {"hidden": args.hidden, "n_layers": args.layers, "n_heads": 4, "n_kv_heads": 2,
                  "ffn_hidden": 2 * args.hidden, "vocab_size": 2048, "tie_embeddings": False, "moe": moe,
                  "execution": {"moe_backend": "loop"}},
        "data": {"seq_len": 16}, "train": {"batch_size": 8, "grad_accum": 2, "device": "cpu"},
        "parallel": parallel})
    layout = Layout.from_config(cfg.parallel, WORLD)
    mesh = build_layout_mesh(layout, 300, torch.device("cpu"))
    hooks = ShardedHooks(mesh, cfg.parallel, seed=0, grad_accum=2, micro_shape=(8 // layout.data_parallel, 16))
    model = hooks.prepare_model(build_meta(cfg.model))
    opt = build_optimizer(model, cfg)
    materialise_optimizer_state(opt)  # the AdamW moments exist, as after a step
    return hooks, TrainState(model, opt, build_scheduler(opt, cfg.train), step=1)


def _rank(rank: int, port: int, out: str, what: str, layout: str, url: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    try:
        hooks, state = _engine(LAYOUTS[layout], args)
        dist.barrier()
        with Meter() as meter:
            start = time.perf_counter()
            checkpointer = Checkpointer(url, layout=hooks.layout)
            if what == "save":
                checkpointer.save(state)
            else:
                ckpt, _ = checkpointer.latest()
                assert ckpt is not None
                checkpointer.load(ckpt, state)
            seconds = time.perf_counter() - start
        torch.save({"s": seconds, "hashed": meter.hashed, "received": meter.received}, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run(what: str, layout: str, url: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.start_processes(_rank, args=(port, out, what, layout, url, args), nprocs=WORLD, start_method="fork")
        return [torch.load(Path(out) / f"{r}.pt") for r in range(WORLD)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-io-"))
    print(f"{time.strftime('%Y-%m-%d')}, load average {os.getloadavg()[0]:.1f}; hidden {args.hidden}, "
          f"{args.layers} layers, {args.experts} experts; {WORLD} gloo ranks")
    for saved in LAYOUTS:
        url = str(root / saved)
        shutil.rmtree(url, ignore_errors=True)
        result = _run("save", saved, url, args)
        ckpt = Path(url) / "step_00000001"
        shards = {p.name: p.stat().st_size for p in sorted(ckpt.glob("*.distcp"))}
        print(f"\nsaved at {saved}: shard files {', '.join(f'{k} {v / 1e6:.1f} MB' for k, v in shards.items())}")
        for rank, r in enumerate(result):
            print(f"  save rank {rank}: {r['s']:.2f} s, hashed {r['hashed'] / 1e6:.1f} MB, "
                  f"received {r['received'] / 1e3:.0f} kB")
        for loaded in LAYOUTS:
            for rank, r in enumerate(_run("load", loaded, url, args)):
                print(f"  load at {loaded} rank {rank}: {r['s']:.2f} s, verified {r['hashed'] / 1e6:.1f} MB of "
                      f"{sum(shards.values()) / 1e6:.1f} MB of shards")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
