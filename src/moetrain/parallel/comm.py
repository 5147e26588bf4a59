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


@contextmanager
def named_collective(name: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run a collective; re-raise any backend failure as :class:`CollectiveError` naming it.

    Args:
        name: what the collective does, e.g. ``"all_to_all_single (MoE token dispatch)"``.
        group: its process group (``None``: the default group).
    Raises:
        CollectiveError: ``"<name> over ranks [..] failed on rank R: <first line of the backend error>"``.
    """
    try:
        yield
    except RuntimeError as e:  # DistBackendError / DistNetworkError / gloo's RuntimeError all derive from it
        if isinstance(e, CollectiveError):
            raise
        raise collective_error(name, group, e) from e


def collective_error(name: str, group: dist.ProcessGroup | None, cause: BaseException) -> CollectiveError:
    """The :class:`CollectiveError` of :func:`named_collective` for ``cause`` (its first line is the reason)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return CollectiveError(
        f"collective {name} over ranks {group_ranks(group)} failed on rank {rank} (a peer rank died, hung past "
        f"parallel.timeout_s, or the network failed): {reason}"
    )


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

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_tensor(self) -> torch.Tensor:
        """[6] int64 in field order (for an all-gather to rank 0)."""
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.int64)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
