"""Atomic, verified checkpoints on a local disk or any fsspec URL (``s3://bucket/prefix`` via s3fs, ...).

Layout of ``ROOT/step_00000100/``: docs/train-state.md; crash safety: docs/checkpoints.md. ``manifest.json``,
written last, holds the size and SHA-256 of every file and of its own content; a checkpoint is trusted only after
every file read matches it, and each file is read once (the verified bytes are what gets deserialised). Locally a
checkpoint is built in a hidden ``.tmp-step_...`` directory, fsynced and renamed into place; on an object store
the manifest is uploaded last. A sharded save (:mod:`moetrain.train.checkpointer`) stages the same way:
:meth:`CheckpointStore.begin`, every rank's :meth:`CheckpointStore.digest`, rank 0's :meth:`CheckpointStore.commit`.

Fault injection (tests only): ``MOETRAIN_CKPT_WRITE_DELAY=SECONDS`` sleeps after each file written, so a test can
kill the process in the middle of a checkpoint write; :func:`_replace_stage` is called between the steps of a file
replacement, so a test can raise there.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from moetrain.errors import CheckpointError

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
WRITE_DELAY_ENV = "MOETRAIN_CKPT_WRITE_DELAY"
_NAME = re.compile(r"^step_(\d{8})$")
_STALE_PREFIXES = (".tmp-step_", ".trash-step_")
_REPLACE = re.compile(r"^\.tmp-(step_\d{8})-replace-\d+$")  # CheckpointStore.replace_files' new version


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> int:
    """The step in a checkpoint directory name that :data:`_NAME` matched (``names()`` lists only those)."""
    match = _NAME.match(name)
    assert match is not None, name
    return int(match.group(1))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_CHUNK = 8 << 20  # bytes read at a time when hashing a file: memory stays flat whatever the shard's size


def stream_digest(stream: IO[bytes], copy_to: IO[bytes] | None = None) -> dict[str, Any]:
    """``{"bytes": n, "sha256": hex}`` of everything left in ``stream``, read in 8 MiB pieces (each also written to
    ``copy_to`` if given: a download verified on the way)."""
    digest, size = hashlib.sha256(), 0
    while piece := stream.read(_CHUNK):
        digest.update(piece)
        size += len(piece)
        if copy_to is not None:
            copy_to.write(piece)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _fsync_dir(path: Path) -> None:
    """fsync a directory so that renames and new entries in it survive a power loss (POSIX; a no-op elsewhere)."""
    with contextlib.suppress(OSError):  # some filesystems (and Windows) refuse to open or fsync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory: write, fsync, rename, fsync the
    directory. A crash leaves the old file or the new one, never a mix (used for the run's config and tokenizer)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _write_synced(tmp, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _replace_stage(stage: str) -> None:
    """Called between the steps of :meth:`CheckpointStore.replace_files` (``built``, ``old_moved``, ``new_in``);
    a no-op that tests monkeypatch to simulate a crash there."""


def _manifest(step: int, files: dict[str, bytes], meta: dict[str, Any] | None = None,
              digests: dict[str, dict[str, Any]] | None = None) -> bytes:
    """``manifest.json``: format, step, each file's size and SHA-256 (of ``files``' bytes, and ``digests``: those of
    files written elsewhere, e.g. by other ranks), optional ``meta``, and the SHA-256 of all that."""
    entries = {**(digests or {}), **{f: {"bytes": len(b), "sha256": _sha256(b)} for f, b in files.items()}}
    body: dict[str, Any] = {"format": FORMAT_VERSION, "step": step, "files": entries}
    if meta:
        body["meta"] = meta
    return json.dumps({**body, "manifest_sha256": _sha256(_canonical(body))}, indent=1).encode()


def _write_synced(path: Path, raw: bytes) -> None:
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def _check(loc: str, info: dict[str, Any], size: int, sha256: str | None = None) -> None:
    """Raise :class:`CorruptCheckpoint` naming ``loc`` unless ``size`` (and ``sha256``, if given) match ``info``, the
    file's manifest entry."""
    if size != info["bytes"]:
        raise CorruptCheckpoint(f"{loc}: {size} bytes, the manifest says {info['bytes']} (truncated?)")
    if sha256 is not None and sha256 != info["sha256"]:
        raise CorruptCheckpoint(f"{loc}: SHA-256 does not match the manifest (corrupt)")


def _write_delay() -> None:
    delay = os.environ.get(WRITE_DELAY_ENV)
    if delay:
        time.sleep(float(delay))


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with names sharing one tensor (tied weights) kept once, as contiguous CPU tensors.

    Two entries are the same tensor when they view the same storage with the same offset, shape and stride; empty
    tensors (whose storage pointer is 0) are never merged.
    """
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=False).items():
        if t.device.type != "meta" and t.numel() > 0:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in seen:
                continue
            seen.add(key)
        out[name] = t.detach().to("cpu").contiguous()
    return out


@dataclass
class LoadedCheckpoint:
    """A checkpoint whose files all matched its manifest.

    Attributes:
        name: ``step_XXXXXXXX``.
        step: optimizer steps completed.
        location: where it lives (a local path or a URL), for messages.
        files: file name -> verified bytes.
        deferred: the files not read yet (a sharded checkpoint's shards, see :meth:`CheckpointStore.read_verified`),
            name -> their manifest entry (``bytes``, ``sha256``); present with the manifest's size, each verified
            by :meth:`verify_file` when a rank reads it.
        store: the store it was read from (``None``: built by hand, nothing deferred).
    """

    name: str
    step: int
    location: str
    files: dict[str, bytes]
    deferred: dict[str, dict[str, Any]] = field(default_factory=dict)
    store: "CheckpointStore | None" = field(default=None, repr=False)

    @property
    def local_dir(self) -> Path | None:
        """The checkpoint's directory on a local store (where a reader can open its files), else ``None``."""
        return self.store.root / self.name if self.store is not None and self.store.local else None

    def verify_file(self, file: str, copy_to: Path | None = None) -> None:
        """Read deferred ``file`` once from the store (8 MiB at a time) and check its size and SHA-256 against the
        manifest; with ``copy_to``, the bytes read are written there too (a download verified in one read).

        Raises:
            CorruptCheckpoint: the file is missing, of another size, or of another SHA-256 (the message names it).
            KeyError: ``file`` is not deferred.
        """
        info = self.deferred[file]
        assert self.store is not None, "deferred files come from a store"
        loc = self.store.location(self.name, file)
        try:
            with (self.store.fs.open(self.store.path(self.name, file), "rb") as stream,
                  open(copy_to, "wb") if copy_to is not None else contextlib.nullcontext() as out):
                got = stream_digest(stream, out)
        except (FileNotFoundError, IsADirectoryError):
            raise CorruptCheckpoint(f"{loc}: missing") from None
        _check(loc, info, got["bytes"], got["sha256"])

    def model_tensors(self) -> dict[str, torch.Tensor]:
        return safetensors_load(self.files[MODEL_FILE])

    def train_state(self) -> dict[str, Any]:
        """The ``train_state.pt`` content.

        Raises:
            CheckpointError: it does not deserialise (e.g. written by an incompatible version).
        """
        try:
            state: dict[str, Any] = torch.load(io.BytesIO(self.files[STATE_FILE]), map_location="cpu",
                                               weights_only=True)
            return state
        except Exception as e:  # noqa: BLE001 -- torch.load raises many types (UnpicklingError, RuntimeError, ...)
            raise CheckpointError(f"{self.location}/{STATE_FILE}: cannot load: {str(e).splitlines()[0]}") from None


@dataclass(frozen=True)
class Staging:
    """Where a checkpoint's files are written before :meth:`CheckpointStore.commit` publishes them (plain strings:
    rank 0 broadcasts it to the other ranks of a sharded save).

    Attributes:
        name: the checkpoint's name, ``step_XXXXXXXX``.
        path: a local directory, or the object store's path (``bucket/prefix/step_...``, no protocol).
        checkpoint_id: the same as a local path or a URL with its protocol (what a DCP writer is given).
    """

    name: str
    path: str
    checkpoint_id: str


class CheckpointStore:
    """The checkpoints of one run, in a local directory or under an fsspec URL.

    Args:
        url: a local path (``str`` or ``Path``), ``file://...``, or a URL of any fsspec filesystem, e.g.
            ``s3://bucket/run1/checkpoints`` (needs s3fs; endpoint and credentials come from the usual AWS
            environment variables, or ``FSSPEC_S3_ENDPOINT_URL`` / ``FSSPEC_S3_KEY`` / ``FSSPEC_S3_SECRET``).
    Raises:
        CheckpointError: an unknown protocol, or one whose fsspec implementation is not installed.
    """

    def __init__(self, url: str | os.PathLike[str]):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.url = str(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url)
        except ImportError as e:
            raise CheckpointError(f"checkpoint storage '{self.url}': a package is missing: {e}") from None
        except ValueError as e:
            raise CheckpointError(f"checkpoint storage '{self.url}': {e}") from None
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = Path(root) if self.local else root.rstrip("/")

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def location(self, name: str, file: str | None = None) -> str:
        """Human-readable location of checkpoint ``name`` (or of one of its files)."""
        if self.local:
            p = self.root / name
            return str(p / file if file else p)
        base = self.url.rstrip("/") + "/" + name
        return f"{base}/{file}" if file else base

    def path(self, *parts: str) -> str:
        """The path of ``ROOT/part/...`` as ``self.fs`` names it (local or remote)."""
        return "/".join([str(self.root), *parts])

    # -- listing and reading -----------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Names of the checkpoint directories (complete or not), oldest first."""
        self.fs.invalidate_cache(self.root)  # s3fs caches listings; another process may have written since
        try:
            entries = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(str(self.root), detail=True)
                       if e["type"] == "directory"]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in entries if _NAME.match(n))

    def _read(self, name: str, file: str) -> bytes:
        """Raises FileNotFoundError when missing; other I/O errors propagate."""
        data: bytes = self.fs.cat_file(self.path(name, file))
        return data

    def read_verified(self, name: str, defer: Callable[[str], bool] | None = None) -> LoadedCheckpoint:
        """Read every file of checkpoint ``name`` once and check it against the manifest; files for which
        ``defer(file)`` is true (a sharded checkpoint's shards) are only checked to exist with the manifest's size
        and left in :attr:`LoadedCheckpoint.deferred`, for the rank that reads one to verify it.

        Raises:
            CorruptCheckpoint: the manifest is missing, unreadable or altered, or a file is missing, has another
                size, or another SHA-256; the message names the file and the reason.
        """
        manifest_loc = self.location(name, MANIFEST)
        try:
            manifest = json.loads(self._read(name, MANIFEST))
            body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
            files = body["files"]
            if manifest["manifest_sha256"] != _sha256(_canonical(body)):
                raise CorruptCheckpoint(f"{manifest_loc}: SHA-256 of the manifest does not match (corrupt)")
            if body["step"] != step_of(name):
                raise CorruptCheckpoint(f"{manifest_loc}: step {body['step']} does not match the directory name")
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{manifest_loc}: missing (checkpoint never completed?)") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpoint(f"{manifest_loc}: unreadable manifest ({e.__class__.__name__})") from None
        data: dict[str, bytes] = {}
        deferred: dict[str, dict[str, Any]] = {}
        for file, info in files.items():
            loc = self.location(name, file)
            later = defer is not None and defer(file)
            try:
                raw = None if later else self._read(name, file)
                size = int(self.fs.size(self.path(name, file))) if raw is None else len(raw)
            except (FileNotFoundError, IsADirectoryError):
                raise CorruptCheckpoint(f"{loc}: missing") from None
            _check(loc, info, size, None if raw is None else _sha256(raw))
            if raw is None:
                deferred[file] = info
            else:
                data[file] = raw
        return LoadedCheckpoint(name=name, step=body["step"], location=self.location(name), files=data,
                                deferred=deferred, store=self)

    def verify(self, name: str) -> str | None:
        """``None`` if checkpoint ``name`` verifies (every file, each streamed through SHA-256 in 8 MiB pieces: a
        sharded checkpoint's shards are never all in memory), else the reason (naming the file)."""
        try:
            ckpt = self.read_verified(name, defer=lambda file: True)
            for file in ckpt.deferred:
                ckpt.verify_file(file)
        except CorruptCheckpoint as e:
            return str(e)
        return None

    def latest_valid(self, warn: Callable[[str], None] = print, defer: Callable[[str], bool] | None = None,
                     before: str | None = None) -> tuple[LoadedCheckpoint | None, list[str]]:
        """The newest checkpoint (older than ``before`` if given) that verifies (``defer``: see
        :meth:`read_verified`), and the names of the newer ones that did not (each is reported through ``warn``
        with its location and reason). ``(None, [...])`` when none verifies."""
        skipped: list[str] = []
        for name in reversed(self.names()):
            if before is not None and name >= before:
                continue
            try:
                return self.read_verified(name, defer), skipped
            except CorruptCheckpoint as e:
                warn(f"warning: skipping checkpoint {self.location(name)}: {e}")
                skipped.append(name)
        return None, skipped

    # -- writing -----------------------------------------------------------------------------------------------
    def save(self, step: int, files: dict[str, bytes]) -> str:
        """Write checkpoint ``step`` with ``files`` (name -> bytes) and its manifest (:meth:`begin`, :meth:`commit`;
        a re-saved step is replaced); returns its location.

        Raises:
            MachineError: a local write failed (full or read-only disk); its temporary directory is removed.
        """
        return self.commit(step, self.begin(step), files)

    def begin(self, step: int) -> "Staging":
        """Where checkpoint ``step``'s files are written before :meth:`commit` publishes them (called by one writer;
        every rank may then write into it): locally a fresh ``.tmp-step_...-PID`` directory (crashed saves' removed
        first); on an object store the checkpoint's own prefix, its old manifest (a re-saved step) deleted first.

        Raises:
            MachineError: a local write failed (full or read-only disk).
        """
        from moetrain.runtime.oserrors import writing

        name = checkpoint_name(step)
        if not self.local:
            manifest_path = self.path(name, MANIFEST)
            if self.fs.exists(manifest_path):  # invalidate the old checkpoint before touching its files
                self.fs.rm_file(manifest_path)
            return Staging(name, self.path(name), self.location(name))
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        with writing(f"checkpoint {name}", tmp):
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._remove_stale()
                tmp.mkdir()
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return Staging(name, str(tmp), str(tmp))

    def staged_files(self, staging: "Staging") -> list[str]:
        """The names of the files in ``staging`` so far, sorted."""
        self.fs.invalidate_cache(staging.path)  # s3fs caches listings; other ranks have written since
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(staging.path, detail=True)
                      if e["type"] == "file")

    def digest(self, staging: "Staging", file: str) -> dict[str, Any]:
        """Size and SHA-256 of ``file`` as it is stored in ``staging`` (read back in 8 MiB pieces): a rank's
        verification of what it wrote, and its entry in the manifest.

        Raises:
            OSError: the file cannot be read.
        """
        with self.fs.open(f"{staging.path}/{file}", "rb") as f:
            return stream_digest(f)

    def commit(self, step: int, staging: "Staging", files: dict[str, bytes],
               digests: dict[str, dict[str, Any]] | None = None) -> str:
        """Write ``files`` into ``staging`` and the manifest of those and of ``digests`` (files already there, as
        :meth:`digest` measured them), then publish: locally fsynced and renamed into place, remotely the manifest
        uploaded last. Returns the checkpoint's location.

        Raises:
            MachineError: a local write failed; the temporary directory is removed, every earlier checkpoint intact.
        """
        name = checkpoint_name(step)
        manifest = _manifest(step, files, digests=digests)
        if self.local:
            self._build_local(name, Path(staging.path), files, manifest)
            self._swap_in(name, Path(staging.path))
        else:
            for file, raw in files.items():
                self.fs.pipe_file(self.path(name, file), raw)
                _write_delay()
            self.fs.pipe_file(self.path(name, MANIFEST), manifest)  # last: commits the checkpoint
            self.fs.invalidate_cache(self.root)
        return self.location(name)

    def abort(self, staging: "Staging") -> None:
        """Remove a local staging directory whose checkpoint will not be committed (remotely nothing: without a
        manifest the files never verify, and the next save of the step overwrites them)."""
        if self.local:
            shutil.rmtree(staging.path, ignore_errors=True)

    def _build_local(self, name: str, tmp: Path, files: dict[str, bytes], manifest: bytes,
                     link: dict[str, Path] | None = None) -> None:
        """Write ``files`` and then ``manifest`` into ``tmp`` (created if needed), each fsynced, and fsync ``tmp``;
        a file of ``link`` is hard-linked from there instead (its bytes written where the link fails).

        Raises:
            MachineError: a write failed (full or read-only disk: one line naming the checkpoint); ``tmp`` is
                removed, nothing else touched.
        """
        from moetrain.runtime.oserrors import writing

        with writing(f"checkpoint {name}", tmp):
            try:
                tmp.mkdir(exist_ok=True)
                for file, raw in [*files.items(), (MANIFEST, manifest)]:
                    try:  # a hard link copies no bytes
                        os.link((link or {})[file], tmp / file)
                    except (KeyError, OSError):  # not to be linked, or the filesystem refuses: write the bytes
                        _write_synced(tmp / file, raw)
                        _write_delay()
                _fsync_dir(tmp)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise

    def _swap_in(self, name: str, tmp: Path, stage: Callable[[str], None] | None = None) -> None:
        """Rename the complete ``tmp`` to ``name``; a directory already there is renamed away first and removed
        last. ``stage`` is called after each step (``built``, ``old_moved``, ``new_in``)."""
        final, trash = self.root / name, self.root / f".trash-{name}-{os.getpid()}"
        stage = stage or (lambda where: None)
        stage("built")
        replaced = final.exists()
        if replaced:
            os.rename(final, trash)
        stage("old_moved")
        os.rename(tmp, final)
        _fsync_dir(self.root)
        stage("new_in")
        if replaced:
            shutil.rmtree(trash, ignore_errors=True)

    def manifest(self, name: str) -> dict[str, Any] | None:
        """The parsed ``manifest.json`` of checkpoint ``name``, not verified (a cheap look at its ``meta``);
        ``None`` when it is missing or unreadable."""
        try:
            manifest = json.loads(self._read(name, MANIFEST))
        except (OSError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) else None

    def replace_files(self, ckpt: LoadedCheckpoint, new: dict[str, bytes], meta: dict[str, Any]) -> bool:
        """Replace some files of a verified local checkpoint and record ``meta`` in its new manifest, crash-safely
        (docs/checkpoints.md). Returns ``False`` (nothing done) on an object store (no atomic rename) and for a
        checkpoint read with deferred files.

        Args:
            ckpt: the checkpoint as read by :meth:`read_verified` (its unchanged files are hard-linked from disk;
                their verified bytes are written instead where a link fails).
            new: file name -> new bytes (each must be one of ``ckpt``'s files).
            meta: JSON data for the manifest's ``meta`` entry (e.g. ``{"optimizer_state": False}``).
        Raises:
            MachineError: a write failed (full or read-only disk); the temporary directory is removed and the
                checkpoint is untouched.
        """
        if not self.local or ckpt.deferred:  # deferred: a sharded checkpoint read without its shards' bytes
            return False
        files = {**ckpt.files, **new}
        tmp = self.root / f".tmp-{ckpt.name}-replace-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        unchanged = {f: self.root / ckpt.name / f for f in ckpt.files if f not in new}
        self._build_local(ckpt.name, tmp, files, _manifest(ckpt.step, files, meta), link=unchanged)
        self._swap_in(ckpt.name, tmp, _replace_stage)
        return True

    def _remove_stale(self) -> None:
        """Temporary directories left by a crashed save (one trainer writes a run's checkpoints at a time). A
        replacement interrupted between its two renames (the checkpoint's name is free, its new version complete in
        ``.tmp-step_...-replace-...``) is renamed into place first, and kept only if it verifies."""
        for p in self.root.iterdir():
            replaced = _REPLACE.match(p.name)
            if p.is_dir() and replaced and not (self.root / replaced.group(1)).exists():
                os.rename(p, self.root / replaced.group(1))
                _fsync_dir(self.root)
                if self.verify(replaced.group(1)) is not None:
                    self.delete(replaced.group(1))
            elif p.is_dir() and p.name.startswith(_STALE_PREFIXES):
                shutil.rmtree(p, ignore_errors=True)

    def delete(self, name: str) -> None:
        """Remove checkpoint ``name``. Locally it is first renamed to a hidden ``.trash-`` name (atomic), so a crash
        during the removal leaves no half-deleted directory under a checkpoint's name; remotely the manifest goes
        first, so a half-deleted checkpoint no longer verifies."""
        if self.local:
            trash = self.root / f".trash-{name}-{os.getpid()}"
            os.rename(self.root / name, trash)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):  # an incomplete upload has none
                self.fs.rm_file(self.path(name, MANIFEST))
            self.fs.rm(self.path(name), recursive=True)

    def prune(self, keep: int, milestone_every: int = 0) -> list[str]:
        """Delete all but the newest ``keep`` checkpoints, sparing milestones (steps that are multiples of
        ``milestone_every`` > 0); returns the deleted names."""
        names = self.names()
        kept = set(names[-keep:]) if keep > 0 else set()
        if milestone_every > 0:
            kept |= {n for n in names if step_of(n) % milestone_every == 0}
        deleted = [n for n in names if n not in kept]
        for n in deleted:
            self.delete(n)
        return deleted

    def quarantine(self, name: str) -> str:
        """Move checkpoint ``name`` aside as ``corrupt-step_...-TIME`` (kept for inspection, never loaded);
        returns the new location."""
        new = f"corrupt-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if self.local:
            os.rename(self.root / name, self.root / new)
            _fsync_dir(self.root)
        else:
            src = self.path(name)
            for obj in self.fs.find(src):  # object by object: prefix "directories" do not move as a whole everywhere
                self.fs.copy(obj, self.path(new) + obj[len(src):])
            self.fs.rm(src, recursive=True)
            self.fs.invalidate_cache(self.root)
        return self.location(new)


class CorruptCheckpoint(CheckpointError):
    """A checkpoint that fails verification against its manifest (the message names the file and the reason)."""


def encode_model(model: torch.nn.Module) -> bytes:
    """safetensors bytes of :func:`model_tensors`. One metadata key only: safetensors keeps metadata in a hash map,
    so several keys would come out in a different order in each process (and identical runs in different bytes)."""
    return safetensors_save(model_tensors(model), metadata={"format": "pt"})


def encode_state(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def load_model_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy ``tensors`` (from :meth:`LoadedCheckpoint.model_tensors`) into ``model``.

    Raises:
        CheckpointError: a missing or extra tensor, or a shape mismatch; the first mismatching tensor (in the
            model's order) is named with both shapes, and ``where`` says which file.
    """
    expected = model_tensors(model)
    for name, t in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{where}: tensor '{name}' is missing (checkpoint from a different model?)")
        if tensors[name].shape != t.shape:
            raise CheckpointError(
                f"{where}: tensor '{name}' has shape {tuple(tensors[name].shape)}, the model expects "
                f"{tuple(t.shape)} (checkpoint from a different model shape)")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor '{extra[0]}' (checkpoint from a different model?)")
    model.load_state_dict(tensors, strict=False)
