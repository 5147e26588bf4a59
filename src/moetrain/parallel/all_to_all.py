"""All-to-all token dispatcher for expert parallelism (the default ``parallel.dispatcher``).

Legend: T = this rank's tokens, D = hidden, E = experts, K = top-k, N = T * K assignments, P = ep (ranks in the
EP group), E_l = E / P local experts, S = rows this rank sends, R = rows its experts receive, C = capacity.

Each token travels only to the ranks holding its experts (Megatron-Core ``MoEAlltoAllTokenDispatcher``, torchtitan
``token_dispatcher.py``):

1. permute: the local dispatcher (:class:`~moetrain.moe.dispatch.LocalDispatcher`, the single-device reference)
   lays this rank's rows out expert by expert (dropped assignments last, or C slots per expert in the capacity
   layout); experts live on ranks in contiguous blocks, so the rows are then grouped by destination rank too;
2. exchange counts: ``all_to_all_single`` of the [E] row counts -> [P, E_l] rows each source rank sends to each
   local expert. One host sync: uneven split sizes must be Python ints;
3. exchange rows: ``all_to_all_single`` with those uneven splits -> [R, D], ordered (source rank, local expert);
4. regroup by local expert (stable: source-rank order within an expert) for one grouped GEMM (or, in the
   capacity layout, P * C rows per local expert for the padded backend);

``combine`` undoes 4 and 3 (the reverse exchange) and hands the rows to the local dispatcher's combine, so the
weighted sum over each token's K outputs is the reference's own code. Gradients flow back through the same
exchanges reversed (:func:`~moetrain.parallel.exchange.all_to_all`).

Capacity (token dropping) is decided by the layer on this rank's tokens before dispatch, so C bounds what one
rank's micro-batch sends to one expert (Megatron-Core computes it from the local tokens too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from moetrain.moe.dispatch import DispatchMeta
from moetrain.parallel.ep_dispatcher import EPDispatcher
from moetrain.parallel.exchange import KeepGradPath, all_to_all, all_to_all_rows, wire_dtype


@dataclass(frozen=True)
class AllToAllMeta:
    """What :meth:`AllToAllDispatcher.combine` needs to undo :meth:`AllToAllDispatcher.dispatch`.

    Attributes:
        local: the local dispatcher's metadata for this rank's own layout (N or E * C rows).
        local_rows: rows of that layout (the first S were sent, the rest are dropped rows).
        send_splits: rows sent to each rank of the EP group (P Python ints, sum S).
        recv_splits: rows received from each rank (P Python ints, sum R).
        regroup: [R] int64, ``received[regroup]`` is grouped by local expert.
        received: [max(R, 1), D] the grouped rows handed to the experts (kept so the backward always reaches
            the exchange; one zero row when R = 0).
    """

    local: DispatchMeta
    local_rows: int
    send_splits: list[int]
    recv_splits: list[int]
    regroup: torch.Tensor
    received: torch.Tensor


class AllToAllDispatcher(EPDispatcher):
    """All-to-all dispatch over the EP group of ``mesh``: ``dispatch`` returns the rows of this rank's ``E / ep``
    experts only (so the layer's ``experts`` must be sharded: :func:`moetrain.parallel.layout.shard_experts`). Dropless,
    dropping (``keep``) and the capacity layout (``capacity``) are all supported. Arguments as
    :class:`~moetrain.parallel.ep_dispatcher.EPDispatcher`.
    """

    def dispatch(
        self,
        tokens: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        keep: torch.Tensor | None = None,
        capacity: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AllToAllMeta]:
        """:meth:`moetrain.moe.dispatcher.Dispatcher.dispatch` of this rank's [T, D] tokens, C rows per expert per
        source rank in the capacity layout.

        Returns:
            (rows [R, D] grouped by local expert, rows per local expert [E_l] int64, meta).
        Raises:
            CollectiveError: a peer failed during the counts or rows exchange.
        """
        p, e_local = self.ep, len(self.local_experts)
        rows, counts, local_meta = self.permuter.dispatch(tokens, topk_ids, topk_weights, keep=keep, capacity=capacity)
        rows = wire_dtype(rows)  # bf16 on the wire under autocast: what the experts compute in anyway
        counts_recv = all_to_all_rows(counts, [e_local] * p, [e_local] * p, self.group,
                                      f"all_to_all_single (MoE token counts, {self.name})").view(p, e_local)
        # One host sync for both split lists (all_to_all_single takes Python ints).
        send, recv = torch.stack([counts.view(p, e_local).sum(1), counts_recv.sum(1)]).tolist()
        received = all_to_all(rows[: sum(send)], recv, send, self.group,
                              f"all_to_all_single (MoE token dispatch, {self.name})")  # [R, D]
        block_expert = torch.arange(e_local, device=tokens.device).repeat(p)  # [P * E_l] expert of each (source, e)
        row_expert = torch.repeat_interleave(block_expert, counts_recv.reshape(-1), output_size=sum(recv))  # [R]
        regroup = torch.sort(row_expert, stable=True).indices  # [R]
        # An empty [0, D] input trips grouped_mm; rows past the last expert's are ignored by every backend.
        grouped = F.pad(received[regroup], (0, 0, 0, 1 if sum(recv) == 0 else 0))  # [max(R, 1), D]
        if (stats := self.counting()) is not None:  # bytes in the dtype on the wire
            stats.add_dispatch(sum(send), sum(send) - send[self.ep_rank], rows.shape[1] * rows.element_size(),
                               sum(recv))
        meta = AllToAllMeta(local=local_meta, local_rows=rows.shape[0], send_splits=send, recv_splits=recv,
                            regroup=regroup, received=grouped)
        return grouped, counts_recv.sum(0), meta

    def combine(self, expert_out: torch.Tensor, meta: AllToAllMeta) -> torch.Tensor:
        """expert_out (y): [R, D] expert outputs in dispatch order -> [T, D] (dtype of y):
        ``sum_k kept_k * weight_k * y_k`` per token, by :meth:`moetrain.moe.dispatch.LocalDispatcher.combine`
        (fp32 accumulation, fixed order).

        Raises:
            CollectiveError: a peer failed during the return exchange.
        """
        y = cast(torch.Tensor, KeepGradPath.apply(expert_out, meta.received))  # type: ignore[no-untyped-call]
        y = y[: meta.regroup.numel()]
        inverse = torch.empty_like(meta.regroup)
        inverse[meta.regroup] = torch.arange(meta.regroup.numel(), device=meta.regroup.device)
        back = all_to_all(y[inverse], meta.send_splits, meta.recv_splits, self.group,
                          f"all_to_all_single (MoE combine, {self.name})")  # [S, D] in this rank's layout
        if (stats := self.counting()) is not None:
            stats.combine_bytes_sent += y.shape[0] * y.shape[1] * y.element_size()
        # Dropped rows were never sent; the local combine ignores them, zeros stand in.
        back = F.pad(back, (0, 0, 0, meta.local_rows - back.shape[0]))
        return self.permuter.combine(back, meta.local)
