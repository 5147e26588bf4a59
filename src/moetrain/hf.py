"""``moetrain.hf``: the public name of the Hugging Face ``Trainer`` integration, kept for existing code
(``moetrain.hf.accelerate(model)``, ``moetrain.hf.add_moe_logging(trainer, stats)``). It lives in
:mod:`moetrain.interop.hf_trainer`; Hugging Face checkpoint conversion (``to_hf`` / ``from_hf``) is
:mod:`moetrain.interop.hf`.
"""

from moetrain.interop.hf_trainer import (
    SUPPORTED_BLOCKS,
    AcceleratedMoeBlock,
    HFRoutingSums,
    MoELoggingCallback,
    accelerate,
    add_moe_logging,
)

__all__ = ["SUPPORTED_BLOCKS", "AcceleratedMoeBlock", "HFRoutingSums", "MoELoggingCallback", "accelerate",
           "add_moe_logging"]
