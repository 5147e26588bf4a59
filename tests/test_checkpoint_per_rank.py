"""Sharded checkpoints are written and verified per rank, never gathered on one: gloo ranks, the FSDP2 + pipeline
engine, through the ``Checkpointer``.

1. ``dp_shard=2`` (2 ranks) trains a step and saves. While it saves, every file a rank opens and every byte it
   receives through an object collective (DCP's plans included) is recorded: each rank opens only its own shard
   file (rank 0 also ``.metadata``, which it writes as DCP's coordinator), hashes it, and what reaches another rank
   is a small fraction of one shard (digests and plans, not tensor bytes). The manifest's digest of every shard is
   that of the file on disk.
2. That checkpoint resumes at ``pp=2 x ep=2`` (4 ranks) with the losses of the next two steps of the saving run
   (1e-5), each rank hashing exactly the shard files that hold chunks of the tensors it loads (computed here from
   DCP's metadata and the rank's own tensors, independently of the reader); the 4 ranks save again at step 2.
3. A byte flipped in one shard file of that ``pp=2 x ep=2`` checkpoint: loading it at ``pp=2 x ep=2`` fails on
   every rank with one line naming the file and the ranks that found it, which are exactly the ranks that read it;
   the other stage's ranks never open it.
4. A one-process checkpoint (the single format: ``model.safetensors`` and an index-keyed optimizer state) resumes
   at ``pp=2 x ep=2`` with the losses of the one-process run's next two steps (1e-5).
5. (slow, ``pytest -m slow``) ``torchrun ... moetrain train --resume`` falls back past a checkpoint whose shard
   fails verification when read.
"""

from __future__ import annotations

import builtins
import inspect
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from math import prod
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from _parallel_util import free_port, spawn
from moetrain.parallel import dcp
from moetrain.parallel.engine import ShardedHooks
from moetrain.parallel.layout import Layout, build_layout_mesh
from moetrain.model.transformer import MoETransformer
from moetrain.parallel.meta_init import build_meta, init_parameters
from moetrain.train.checkpoint import MANIFEST, CheckpointStore, CorruptCheckpoint
from moetrain.train.checkpointer import Checkpointer
from moetrain.train.schedule import build_scheduler
from moetrain.train.state import TrainState
from moetrain.train.step import train_step
from moetrain.train.trainer import build_optimizer
from test_fsdp_train import batches, sampler, small_config
from test_parallel_cli import _corpus

ACCUM = 2
CKPT = "step_00000001"
SEED = small_config({}).train.seed


class Spy:
    """While active, on this rank: the names of the files under ``root`` opened for reading and for writing, and
    each object received from another rank through the object collectives (``gather_object``,
    ``broadcast_object_list``, ``all_gather_object``, ``scatter_object_list``: what DCP and the Checkpointer use),
    pickled."""

    def __init__(self, root: Path):
        self.root = str(root)
        self.read: list[str] = []
        self.written: list[str] = []
        self.received: list[bytes] = []
        self._saved: dict = {}

    def _open(self, original):
        def spy(file, mode="r", *args, **kwargs):
            path = str(file) if isinstance(file, (str, Path)) else ""
            if path.startswith(self.root):
                (self.read if set(mode) <= {"r", "b", "t"} else self.written).append(Path(path).name)
            return original(file, mode, *args, **kwargs)
        return spy

    def _collective(self, name, original):
        rank, signature = dist.get_rank(), inspect.signature(original)

        def spy(*args, **kwargs):
            out = original(*args, **kwargs)
            a = signature.bind(*args, **kwargs).arguments  # the default group only: group ranks are global ranks
            if name in ("gather_object", "all_gather_object"):
                gathered = a.get("object_gather_list") if name == "gather_object" else a["object_list"]
                others = [o for i, o in enumerate(gathered or []) if i != rank]
            else:  # broadcast_object_list / scatter_object_list: received unless this rank is the source
                src = a.get("src", a.get("group_src")) or 0
                others = [a["object_list" if name == "broadcast_object_list" else "scatter_object_output_list"]]
                others = others if rank != src else []
            self.received += [pickle.dumps(o) for o in others]
            return out
        return spy

    def __enter__(self) -> "Spy":
        self._saved = {"open": builtins.open, "io_open": io.open}
        builtins.open, io.open = self._open(builtins.open), self._open(io.open)
        for name in ("gather_object", "broadcast_object_list", "all_gather_object", "scatter_object_list"):
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._collective(name, getattr(dist, name)))
        return self

    def __exit__(self, *exc) -> None:
        builtins.open, io.open = self._saved.pop("open"), self._saved.pop("io_open")
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def needed_files(ckpt_dir: Path, model, optimizer, layout) -> list[str]:
    """The shard files holding a chunk that overlaps a tensor this rank loads: its tensors as the checkpoint
    presents them (global views, this rank's chunk of each DTensor) against the chunks and files listed in DCP's
    ``.metadata``."""
    metadata = pickle.loads((ckpt_dir / ".metadata").read_bytes())
    state = dcp._state_dict(model, optimizer, layout)
    if "meta" in metadata.state_dict_metadata:  # the blob of param groups, in checkpoints written before train_state.pt held them
        state["meta"] = io.BytesIO()
    flat, _ = flatten_state_dict(state)
    files = set()
    for fqn, value in flat.items():
        md = metadata.state_dict_metadata[fqn]
        if isinstance(md, BytesStorageMetadata):
            files.add(metadata.storage_data[MetadataIndex(fqn)].relative_path)
            continue
        if isinstance(value, DTensor):
            sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        else:
            sizes, offsets = tuple(value.shape), (0,) * value.dim()
        if prod(sizes) == 0:
            continue
        for chunk in md.chunks:
            if all(o < c + n and c < o + s for o, s, c, n in zip(offsets, sizes, chunk.offsets, chunk.sizes)):
                files.add(metadata.storage_data[MetadataIndex(fqn, chunk.offsets)].relative_path)
    return sorted(files)


def _engine(world: int, parallel: dict, seed: int, tied: bool = False):
    cfg = small_config(parallel, grad_accum=ACCUM, tied=tied)
    layout = Layout.from_config(cfg.parallel, world)
    hooks = ShardedHooks(build_layout_mesh(layout, 60, torch.device("cpu")), cfg.parallel, seed=seed,
                         grad_accum=ACCUM, micro_shape=(cfg.train.batch_size // layout.data_parallel, cfg.data.seq_len))
    model = hooks.prepare_model(build_meta(cfg.model))
    opt = build_optimizer(model, cfg)
    return cfg, hooks, model, opt, build_scheduler(opt, cfg.train)


def _steps(cfg, hooks, model, opt, sched, data, n: int) -> list[float]:
    return [float(hooks.train_step(model, data, opt, sched, cfg.train, torch.device("cpu")).lm_loss)
            for _ in range(n)]


def _save_dp_shard2(rank: int, world: int, out_dir, url: str) -> dict:
    """Step 1, an observed checkpoint, then steps 2 and 3 (their losses)."""
    cfg, hooks, model, opt, sched = _engine(world, {"dp_shard": 2}, seed=SEED)
    data = hooks.local_batch(sampler(batches(cfg, 3 * ACCUM)))
    _steps(cfg, hooks, model, opt, sched, data, 1)
    with Spy(Path(url)) as spy:
        Checkpointer(url, layout=hooks.layout).save(TrainState(model, opt, sched, step=1), {"config.json": b"{}"})
    return {"losses": _steps(cfg, hooks, model, opt, sched, data, 2), "read": spy.read, "written": spy.written,
            "received": spy.received}


def _resume(rank: int, world: int, out_dir, url: str, parallel: dict, save_url: str | None = None,
            tied: bool = False) -> dict:
    """Load the newest checkpoint into this layout (observed; a CorruptCheckpoint is returned, not raised), then
    steps 2 and 3, saving after step 2 into ``save_url``."""
    cfg, hooks, model, opt, sched = _engine(world, parallel, seed=SEED + 1, tied=tied)  # the load must overwrite it
    state = TrainState(model, opt, sched)
    checkpointer = Checkpointer(url, layout=hooks.layout)
    with Spy(Path(url)) as spy:
        ckpt, _ = checkpointer.latest()  # the manifest and small files read, the shards only stat-ed
        try:
            checkpointer.load(ckpt, state)
            error = None
        except CorruptCheckpoint as e:
            error = str(e)
    local = dcp.is_dcp_files(ckpt.files) and ckpt.local_dir is not None
    out = {"read": spy.read, "error": error,
           "needed": needed_files(ckpt.local_dir, model, opt, hooks.layout) if local else []}
    if error is None:
        data = hooks.local_batch(sampler(batches(cfg, 3 * ACCUM)[ACCUM:]))
        out["losses"] = _steps(cfg, hooks, model, opt, sched, data, 1)
        if save_url is not None:
            state.step = 2
            Checkpointer(save_url, layout=hooks.layout).save(state)
        out["losses"] += _steps(cfg, hooks, model, opt, sched, data, 1)
    return out


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("per_rank")
    url = str(root / "checkpoints")
    ranks = spawn(_save_dp_shard2, 2, root / "save", url, timeout_s=300)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    return root, url, ranks


@pytest.fixture(scope="module")
def pp2_ep2(dp2):
    root, url, _ = dp2
    return root, spawn(_resume, 4, root / "resume", url, {"pp": 2, "ep": 2}, str(root / "pp2ep2"), timeout_s=300)


def _windows(raw: bytes, n: int = 64, most: int = 200) -> list[bytes]:
    """Up to ``most`` 64-byte pieces of a file, evenly spread among those with at least 40 distinct byte values
    (tensor data, not the headers between small tensors or runs of zeros)."""
    pieces = [w for w in (raw[i:i + n] for i in range(0, len(raw) - n, n)) if len(set(w)) >= 40]
    return pieces[::max(1, len(pieces) // most)]


def _shards(files) -> list[str]:
    return sorted(f for f in files if dcp.is_shard_file(f))


def test_each_rank_writes_and_hashes_only_its_own_shard(dp2):
    root, url, ranks = dp2
    ckpt = Path(url) / CKPT
    manifest = json.loads((ckpt / MANIFEST).read_text())["files"]
    on_disk = sorted(p.name for p in ckpt.iterdir())
    assert sorted(manifest) == [f for f in on_disk if f != MANIFEST]
    assert _shards(on_disk) == ["__0_0.distcp", "__1_0.distcp"]
    sizes = {f: (ckpt / f).stat().st_size for f in _shards(on_disk)}
    for rank, r in enumerate(ranks):
        own = f"__{rank}_0.distcp"
        print(f"rank {rank}: opened for reading {sorted(set(r['read']))}, for writing {sorted(set(r['written']))}, "
              f"received {sum(map(len, r['received']))} object bytes; shard files {sizes}")
        assert _shards(r["written"]) == [own]  # DCP's writer: this rank's file only
        assert _shards(r["read"]) == [own]  # read back once, to hash it
        assert (".metadata" in r["read"]) == (rank == 0)
        # What reached this rank from the others (DCP's plans and metadata, the digests, the outcome) holds none
        # of their shard bytes: no high-entropy 64-byte window of another rank's shard occurs in it.
        windows = [w for f in sizes if f != own for w in _windows((ckpt / f).read_bytes())]
        assert len(windows) >= 100
        assert not any(w in payload for w in windows for payload in r["received"])
        assert sum(map(len, r["received"])) < sum(n for f, n in sizes.items() if f != own) / 2
    assert CheckpointStore(url).verify(CKPT) is None  # every digest gathered into the manifest matches the disk


def test_dp_shard2_checkpoint_resumes_in_a_pipeline(dp2, pp2_ep2):
    _, _, saved = dp2
    _, ranks = pp2_ep2
    want = saved[0]["losses"]
    for rank, r in enumerate(ranks):
        print(f"pp2 x ep2 rank {rank}: losses {r['losses']} (saving run {want}); hashed {_shards(r['read'])}")
        assert r["error"] is None
        assert max(abs(a - b) for a, b in zip(r["losses"], want)) <= 1e-5, (rank, r["losses"], want)
        # verified = read: each file the rank needs, hashed once and read once by DCP; no other shard file opened
        assert _shards(set(r["read"])) == r["needed"] and r["needed"]
        assert all(r["read"].count(f) == 2 for f in r["needed"])


def test_corrupt_shard_is_found_by_the_ranks_that_read_it(pp2_ep2, tmp_path):
    root, _ = pp2_ep2
    url = tmp_path / "checkpoints"
    shutil.copytree(root / "pp2ep2", url)
    victim = Path(url) / "step_00000002" / "__3_0.distcp"  # written by rank 3, a stage-1 rank
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    ranks = spawn(_resume, 4, tmp_path / "w", str(url), {"pp": 2, "ep": 2}, timeout_s=300)
    readers = [rank for rank, r in enumerate(ranks) if victim.name in r["needed"]]
    print("readers of", victim.name, readers, [r["error"] for r in ranks])
    assert readers and len(readers) < 4  # the stage-0 ranks hold none of its tensors
    who = f"rank {readers[0]}" if len(readers) == 1 else f"ranks {', '.join(map(str, readers))}"
    for rank, r in enumerate(ranks):
        assert r["error"] == f"{victim}: SHA-256 does not match the manifest (corrupt) (found by {who}, which read it)"
        assert "\n" not in r["error"]
        assert (victim.name in r["read"]) == (rank in readers)


def test_one_process_checkpoint_resumes_in_a_pipeline(tmp_path):
    """With tied embeddings: the single-file checkpoint holds the shared weight once; the last stage's copy of it
    (its LM head) loads from the embedding, weights and AdamW moments."""
    cfg = small_config({}, grad_accum=ACCUM, tied=True)
    model = MoETransformer(cfg.model)
    init_parameters(model, cfg.model, seed=cfg.train.seed)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg.train)
    data = sampler(batches(cfg, 3 * ACCUM))
    train_step(model, data, opt, sched, cfg.train, torch.device("cpu"))
    url = tmp_path / "checkpoints"
    Checkpointer(url).save(TrainState(model, opt, sched, step=1))
    assert sorted(CheckpointStore(url).read_verified(CKPT).files) == ["model.safetensors", "train_state.pt"]
    want = [float(train_step(model, data, opt, sched, cfg.train, torch.device("cpu")).lm_loss) for _ in range(2)]
    for rank, r in enumerate(spawn(_resume, 4, tmp_path / "w", str(url), {"pp": 2, "ep": 2}, None, True,
                                   timeout_s=300)):
        print(f"one process -> pp2 x ep2 rank {rank}: {r['losses']} (one process {want})")
        assert max(abs(a - b) for a, b in zip(r["losses"], want)) <= 1e-5, (rank, r["losses"], want)


def _torchrun(world: int, args: list[str], log: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "moetrain", *args],
                          capture_output=True, text=True, env=env, timeout=600)
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_resume_skips_a_checkpoint_whose_shard_is_corrupt(tmp_path):
    """``torchrun ... moetrain train --resume`` at ``dp_shard=2``: the newest checkpoint's shard of rank 1 has a
    flipped byte, found only when it is read; both ranks fall back to the previous checkpoint, the corrupt one is
    moved aside, and the resumed steps log the losses of the first run."""
    _corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--data", str(tmp_path / "corpus"), "--out", str(run), "--no-progress",
            f"data.cache_dir={tmp_path / 'cache'}", "train.steps=4", "train.log_every=1", "train.eval_every=0",
            "train.eval_batches=1", "train.ckpt_every=2", "model.tie_embeddings=false",
            "parallel.dp_shard=2"]
    _torchrun(2, args, tmp_path / "first.log")
    first = {d["step"]: d["train_loss"] for d in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "train_loss" in d}
    victim = run / "checkpoints" / "step_00000004" / "__1_0.distcp"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    victim.write_bytes(bytes(raw))
    i = args.index("--preset")
    _torchrun(2, [*args[:i], *args[i + 2:], "--resume"], tmp_path / "resume.log")
    log = (tmp_path / "resume.log").read_text()
    assert f"{victim}: SHA-256 does not match the manifest (corrupt) (found by rank" in log, log[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in log, log[-3000:]
    assert [p.name.startswith("corrupt-step_00000004") for p in (run / "checkpoints").iterdir()].count(True) == 1
    again = {d["step"]: d["train_loss"] for d in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "train_loss" in d}
    assert sorted(again) == [1, 2, 3, 4]
    assert all(abs(again[s] - first[s]) <= 1e-6 for s in (3, 4)), (again, first)
