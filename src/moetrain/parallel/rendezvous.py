"""The store the default process group meets in, made safe for torchrun's elastic restarts.

Under ``torchrun --rdzv-backend c10d`` every worker's ``init_process_group`` connects to the agent's own TCPStore
(``TORCHELASTIC_USE_AGENT_STORE=True``), and the agent keeps that store across the restarts of ``--max-restarts``.
Without a prefix per restart, the restarted workers find the keys their predecessors wrote (each rank's gloo
address) and connect to dead ports: ``Gloo connectFullMesh failed ... Connection refused``, seen in torch 2.13 on
2 of 3 restarts here. Every restart therefore meets under ``moetrain/restart_<TORCHELASTIC_RESTART_COUNT>``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

from moetrain.train.restart import torchrun_restart


def init_kwargs(timeout: datetime.timedelta) -> dict[str, Any]:
    """Extra keyword arguments of ``dist.init_process_group``: under torchrun's agent store a client of it with a
    prefix per restart (and the ``rank`` / ``world_size`` an explicit store needs); otherwise none (``env://``)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"moetrain/restart_{torchrun_restart()}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
