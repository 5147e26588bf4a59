"""Serving (``moetrain serve``): an HTTP front (FastAPI + uvicorn) over a continuous-batching engine.

Request path: HTTP -> :mod:`.api` (validation, response cache, SSE) -> :class:`.engine.Engine` (bounded queue,
admission at step boundaries, one batched prefill/decode step for every running sequence) -> :mod:`.forward`
(the model's own weights, run over a ragged batch with per-slot KV caches from :mod:`.kv_cache`) -> MoE layers
through :mod:`.moe` with a routing policy from :mod:`.routing` (fixed | threshold | load top-k, optional int8
router). See docs/serving.md.
"""
