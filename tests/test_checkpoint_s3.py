"""Checkpoints through an S3-compatible server: moto in server mode on 127.0.0.1 (a free port), reached by s3fs
over real HTTP. Nothing leaves the machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from _crash_util import losses_by_step  # noqa: E402
from conftest import sample_text  # noqa: E402
from moetrain.cli import main  # noqa: E402
from moetrain.train.checkpoint import MANIFEST, MODEL_FILE, STATE_FILE, CheckpointStore  # noqa: E402

BUCKET = "moetrain-test"


pytestmark = pytest.mark.usefixtures("one_thread")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """AWS settings pointing s3fs (botocore) at the local server only."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": s3_server, "AWS_ENDPOINT_URL_S3": s3_server,
                       "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(key, raising=False)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # instances are cached per arguments; take the new environment
    fs = s3fs.S3FileSystem()
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    yield fs
    s3fs.S3FileSystem.clear_instance_cache()


def test_round_trip_fallback_and_prune_through_s3(s3_env, request):
    url = f"s3://{BUCKET}/{request.node.name}/checkpoints"
    store = CheckpointStore(url)
    assert not store.local and store.names() == []
    files = {s: {MODEL_FILE: os.urandom(5000 + s), STATE_FILE: os.urandom(300)} for s in (1, 2, 3)}
    for step, f in files.items():
        assert store.save(step, f) == f"{url}/step_{step:08d}"
    store.prune(keep=2)
    assert store.names() == ["step_00000002", "step_00000003"]
    ckpt, skipped = store.latest_valid(warn=lambda m: None)
    assert (ckpt.step, ckpt.files, skipped) == (3, files[3], [])

    # A flipped byte in the newest: fall back to step 2, the warning names the object's URL.
    raw = bytearray(files[3][STATE_FILE])
    raw[17] ^= 0x40
    s3_env.pipe_file(f"{BUCKET}/{request.node.name}/checkpoints/step_00000003/{STATE_FILE}", bytes(raw))
    warnings = []
    ckpt, skipped = store.latest_valid(warn=warnings.append)
    assert ckpt.step == 2 and ckpt.files == files[2] and skipped == ["step_00000003"]
    assert f"{url}/step_00000003/{STATE_FILE}: SHA-256 does not match" in warnings[0]

    # An upload cut short before its manifest (object stores have no atomic rename) is never used.
    s3_env.pipe_file(f"{BUCKET}/{request.node.name}/checkpoints/step_00000004/{MODEL_FILE}", b"partial")
    ckpt, skipped = store.latest_valid(warn=warnings.append)
    assert ckpt.step == 2 and skipped == ["step_00000004", "step_00000003"]
    assert f"{url}/step_00000004/{MANIFEST}: missing" in warnings[-2]

    # Re-saving a step rewrites it whole.
    store.save(3, files[3])
    assert store.verify("step_00000003") is None
    moved = store.quarantine("step_00000004")
    assert "corrupt-step_00000004" in moved and "step_00000004" not in store.names()


def test_training_resumes_exactly_from_s3_checkpoints(s3_env, tmp_path, request):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(sample_text(60_000))
    common = ["--data", str(corpus), "--no-progress", "--steps", "6", f"data.cache_dir={tmp_path / 'cache'}",
              "data.seq_len=32", "train.batch_size=2", "train.log_every=1", "train.ckpt_every=2",
              "train.eval_batches=1", "monitor.tb_heatmap=false", "monitor.tb_histograms=false"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--out", str(ref), *common]) == 0
    url = f"s3://{BUCKET}/{request.node.name}/ckpts"
    assert main(["train", "--preset", "tiny", "--out", str(run), "--stop-at-step", "3", *common,
                 f"train.checkpoint_url={url}"]) == 0
    assert not (run / "checkpoints").exists()
    assert CheckpointStore(url).names() == ["step_00000002", "step_00000003"]
    assert main(["train", "--out", str(run), "--resume", *common]) == 0
    assert losses_by_step(run) == losses_by_step(ref)
    a = CheckpointStore(url).latest_valid()[0].model_tensors()
    b = CheckpointStore(ref / "checkpoints").latest_valid()[0].model_tensors()
    import torch

    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # eval / generate find the weights through the run's config as well.
    assert main(["eval", str(run), "--batches", "1"]) == 0


def test_sharded_checkpoint_through_s3(s3_env, tmp_path, request):
    """``dp_shard=2`` (2 gloo ranks) saves through DCP's fsspec writer, each rank uploading its own shard and
    hashing it as stored; ``pp=2 x ep=2`` (4 ranks) reads it back, each rank downloading and verifying the shard
    files it reads: the next two losses are the saving run's (1e-5)."""
    from test_checkpoint_per_rank import _resume, _save_dp_shard2, spawn

    url = f"s3://{BUCKET}/{request.node.name}/ckpts"
    saved = spawn(_save_dp_shard2, 2, tmp_path / "save", url, timeout_s=300)
    store = CheckpointStore(url)
    assert store.names() == ["step_00000001"] and store.verify("step_00000001") is None
    files = sorted(store.read_verified("step_00000001").files)
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "config.json", "moetrain.json", STATE_FILE]
    for rank, r in enumerate(spawn(_resume, 4, tmp_path / "resume", url, {"pp": 2, "ep": 2}, timeout_s=300)):
        assert r["error"] is None
        assert max(abs(a - b) for a, b in zip(r["losses"], saved[0]["losses"])) <= 1e-5, (rank, r, saved[0])
