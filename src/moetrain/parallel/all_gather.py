"""All-gather token dispatcher for expert parallelism (``parallel.dispatcher = "all_gather"``).

Legend: T = this rank's tokens, T_max = the most tokens on any rank of the EP group, D = hidden, E = experts,
K = top-k, P = ep, E_l = E / P local experts, R = rows for this rank's experts, C = capacity.

Every rank all-gathers the tokens, expert ids, gating weights and keep flags of its EP group, lays out the rows of
its own experts with the local dispatcher (assignments to other ranks' experts count as dropped), computes them,
combines them into a [P * T_max, D] fp32 buffer of partial outputs, and a sum-reduce-scatter returns each rank the
complete output of its own tokens (Megatron-Core ``MoEAllGatherTokenDispatcher``). Simpler than all-to-all and free
of uneven splits, but each rank receives all P * T tokens instead of its share: for small EP groups or as a
cross-check. In the capacity layout each local expert gets P * C slots (C per source rank, in source order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from moetrain.moe.dispatch import DispatchMeta
from moetrain.parallel.ep_dispatcher import EPDispatcher
from moetrain.parallel.exchange import KeepGradPath, all_gather, all_gather_rows, reduce_scatter


@dataclass(frozen=True)
class AllGatherMeta:
    """What :meth:`AllGatherDispatcher.combine` needs.

    Attributes:
        local: the local dispatcher's metadata over the gathered [P * T_max] tokens.
        rows_before / num_rows / rows_total: this rank's R = ``num_rows`` rows start at ``rows_before`` in the
            gathered layout of ``rows_total`` rows.
        received: [max(R, 1), D] rows handed to the experts (kept so the backward always reaches the gather; one
            zero row when R = 0).
        num_tokens: T.
    """

    local: DispatchMeta
    rows_before: int
    num_rows: int
    rows_total: int
    received: torch.Tensor
    num_tokens: int


class AllGatherDispatcher(EPDispatcher):
    """Same interface as :class:`~moetrain.moe.dispatch.LocalDispatcher`; rows for this rank's experts only.
    Arguments as :class:`~moetrain.parallel.ep_dispatcher.EPDispatcher`.
    """

    def dispatch(
        self,
        tokens: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        keep: torch.Tensor | None = None,
        capacity: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AllGatherMeta]:
        """:meth:`moetrain.moe.dispatcher.Dispatcher.dispatch` of this rank's [T, D] tokens.

        Returns:
            (rows [R, D] grouped by local expert, rows per local expert [E_l] int64, meta).
        Raises:
            CollectiveError: a peer failed in one of the gathers.
        """
        p, (t, k) = self.ep, topk_ids.shape
        sizes = all_gather_rows(torch.tensor([t], device=tokens.device), self.group, p,
                                f"all_gather (MoE token counts, {self.name})")
        t_max = int(sizes.max())  # host sync: the padded size
        pad = (0, 0, 0, t_max - t)
        if keep is None:
            keep = torch.ones_like(topk_ids, dtype=torch.bool)
        x_all = all_gather(F.pad(tokens, pad), self.group, p, f"all_gather (MoE tokens, {self.name})")
        w_all = all_gather(F.pad(topk_weights, pad), self.group, p, f"all_gather (MoE gating weights, {self.name})")
        # Expert ids and keep flags travel together (padding rows: not kept).
        ids_keep = torch.cat([topk_ids, keep.to(topk_ids.dtype)], dim=1)
        ids_keep = all_gather_rows(F.pad(ids_keep, pad), self.group, p, f"all_gather (MoE expert ids, {self.name})")
        ids_all, keep_all = ids_keep[:, :k], ids_keep[:, k:].bool()
        mine = (ids_all >= self.local_experts.start) & (ids_all < self.local_experts.stop)
        layout = None if capacity is None else p * capacity
        rows, counts, local_meta = self.permuter.dispatch(x_all, ids_all, w_all, keep=keep_all & mine,
                                                          capacity=layout)
        if layout is None:  # other experts' rows are all "dropped": this rank's rows come first
            before, n = 0, int(counts.sum())  # host sync
        else:
            per_expert = rows.shape[0] // self.num_experts
            before, n = self.local_experts.start * per_expert, len(self.local_experts) * per_expert
        # An empty [0, D] input trips grouped_mm; rows past the last expert's are ignored by every backend.
        grouped = F.pad(rows[before : before + n], (0, 0, 0, 1 if n == 0 else 0))
        if (stats := self.counting()) is not None:
            stats.add_dispatch(t_max, t_max * (p - 1), tokens.shape[1] * tokens.element_size(),
                               int(counts[self.local_experts.start : self.local_experts.stop].sum()))
        meta = AllGatherMeta(local=local_meta, rows_before=before, num_rows=n, rows_total=rows.shape[0],
                             received=grouped, num_tokens=t)
        return grouped, counts[self.local_experts.start : self.local_experts.stop], meta

    def combine(self, expert_out: torch.Tensor, meta: AllGatherMeta) -> torch.Tensor:
        """expert_out (y): [R, D] -> [T, D] (dtype of y): the local combine over the gathered tokens gives partial
        outputs (in fp32, or fp64 for fp64: the local combine's accumulation dtype, never narrower than y), summed
        over the EP group by a reduce-scatter (so the rounding order differs from the local dispatcher's by about
        one ulp).

        Raises:
            CollectiveError: a peer failed in the reduce-scatter.
        """
        y = cast(torch.Tensor, KeepGradPath.apply(expert_out, meta.received))  # type: ignore[no-untyped-call]
        y = y[: meta.num_rows]
        after = meta.rows_total - meta.rows_before - y.shape[0]
        # Partial sums in the local combine's accumulation dtype (fp32, fp64 for fp64: a cast through fp32 lost
        # ~6e-8 in fp64): reduce-scattered, they add up as it would.
        acc = torch.promote_types(y.dtype, torch.float32)
        full = F.pad(y.to(acc), (0, 0, meta.rows_before, after))  # other experts' rows: zeros, ignored
        partial = self.permuter.combine(full, meta.local)  # [P * T_max, D] in acc
        if (stats := self.counting()) is not None:
            stats.combine_bytes_sent += partial.numel() * partial.element_size()
        out = reduce_scatter(partial, self.group, self.ep, f"reduce_scatter (MoE combine, {self.name})")
        return out[: meta.num_tokens].to(y.dtype)
