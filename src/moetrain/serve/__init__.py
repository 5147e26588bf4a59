"""Serving (``moetrain serve``): an HTTP front (FastAPI + uvicorn) over a continuous-batching engine.

Request path: HTTP -> :mod:`.api` (validation, response cache, SSE) -> :class:`.engine.Engine` (bounded queue,
admission at step boundaries, one batched prefill/decode step for every running sequence) -> :mod:`.forward`
(the model's own blocks, run over a ragged batch with the model's per-slot KV cache) -> MoE layers routed by
:mod:`.moe` with a routing policy from :mod:`.routing` (fixed | threshold | load top-k, optional int8 router) as
their routing hook. See docs/serving.md.
"""
