"""Named collectives and per-step communication counters.

Every collective moetrain issues runs inside :func:`named_collective`, so a peer that dies or hangs surfaces as a
:class:`CollectiveError` naming the collective, the group and the time-out, instead of a bare transport error
(gloo: "Connection reset by peer" / "Timed out waiting 5000ms for recv operation").
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Iterator

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, hung past ``parallel.timeout_s``, or the transport broke.

    Not a :class:`~moetrain.errors.MoetrainError` (nothing is wrong with the user's input), but the launcher
    prints it as one line and exits with status 1, so every surviving rank fails fast and clearly.
    """


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (the default group when ``None``)."""
    if group is not None:
        return dist.get_process_group_ranks(group)
    # init_process_group itself failed: no group yet, the world is torchrun's
    return list(range(dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))))


_COMM_WORDS = ("gloo", "Gloo", "NCCL", "nccl", "Connection", "connection", "timed out", "Timed out", "peer",
               "Socket", "socket")


def _comm_cause(error: BaseException) -> BaseException | None:
    """The first exception of ``error``'s chain (``__cause__``, else ``__context__``) that reports a failed
    collective, or ``None``. ``torch.distributed.pipelining`` re-raises a stage's backward error as a plain
    ``RuntimeError("Failed to run stage backward: ...")`` that names no collective: the gloo or NCCL error is its
    cause."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (CollectiveError, dist.DistError)) or (
                isinstance(e, RuntimeError) and any(w in str(e) for w in _COMM_WORDS)):
            return e
        e = e.__cause__ or e.__context__
    return None


@contextmanager
def named_collective(name: str, group: dist.ProcessGroup | None = None, step: bool = False) -> Iterator[None]:
    """Run a collective; re-raise any backend failure as :class:`CollectiveError` naming it.

    Args:
        name: what the collective does, e.g. ``"all_to_all_single (MoE token dispatch)"``.
        group: its process group (``None``: the default group).
        step: the block is a whole step whose collectives run inside FSDP2 and ``torch.distributed.pipelining``:
            only an error whose chain holds a ``DistError`` or a backend error (:func:`_comm_cause`) is renamed, a
            :class:`CollectiveError` moetrain raised inside gets ``(within the step: name)`` appended, and any
            other error (a shape, an allocation) passes through unchanged.
    Raises:
        CollectiveError: ``"<name> over ranks [..] failed on rank R: <first line of the backend error>"``.
    """
    try:
        yield
    except RuntimeError as e:  # DistBackendError / DistNetworkError / gloo's RuntimeError all derive from it
        cause = _comm_cause(e) if step else e
        if cause is None or (isinstance(cause, CollectiveError) and not step):
            raise
        if isinstance(cause, CollectiveError):
            raise CollectiveError(f"{cause} (within the step: {name})") from e
        rank = dist.get_rank() if dist.is_initialized() else 0
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise CollectiveError(f"collective {name} over ranks {group_ranks(group)} failed on rank {rank} (a peer "
                              f"rank died, hung past parallel.timeout_s, or the network failed): {reason}") from e


@dataclass
class CommStats:
    """Rows and bytes one rank moved through the token exchange since the last :meth:`reset` (forward pass only;
    the backward pass moves the same amounts in reverse). Updated only by dispatchers, read by the launcher.

    Attributes:
        dispatch_rows_sent: (token, expert) rows this rank put into the dispatch exchange (rows for its own experts
            included: ``all_to_all_single`` copies them too, locally).
        dispatch_rows_sent_remote: the part of those rows bound for other ranks (what crosses the wire).
        dispatch_bytes_sent / dispatch_bytes_sent_remote: the same in bytes (``rows * D * element size``).
        tokens_received: rows this rank's experts received (from all ranks, itself included).
        combine_bytes_sent: bytes of expert outputs sent back by the combine exchange.
    """

    dispatch_rows_sent: int = 0
    dispatch_rows_sent_remote: int = 0
    dispatch_bytes_sent: int = 0
    dispatch_bytes_sent_remote: int = 0
    tokens_received: int = 0
    combine_bytes_sent: int = 0

    def add_dispatch(self, rows: int, remote: int, row_bytes: int, received: int) -> None:
        """Count one dispatch: ``rows`` sent (``remote`` of them to other ranks) of ``row_bytes`` each, and the
        rows this rank's experts ``received``."""
        self.dispatch_rows_sent += rows
        self.dispatch_rows_sent_remote += remote
        self.dispatch_bytes_sent += rows * row_bytes
        self.dispatch_bytes_sent_remote += remote * row_bytes
        self.tokens_received += received

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_tensor(self) -> torch.Tensor:
        """[6] int64 in field order (for an all-gather to rank 0)."""
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.int64)
