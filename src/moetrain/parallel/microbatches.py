"""The pipeline's micro-batches per step, chosen from the layout when ``train.grad_accum`` was not given (every
schedule but GPipe needs one per stage: :func:`moetrain.parallel.pipeline_runner.check_microbatches`); the rule
is in docs/scale-out.md, Pipeline micro-batches (the step keeps its sequences where they split, as torchtitan's
``local_batch_size / pipeline_parallel_microbatch_size``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from moetrain.parallel.layout import Layout

if TYPE_CHECKING:
    from moetrain.config import Config


def given(*sources: dict[str, Any] | None) -> bool:
    """Whether any of the nested config dicts ``sources`` (a preset's, a ``--config`` file's, the overrides) sets
    ``train.grad_accum``."""
    return any(isinstance(s, dict) and isinstance(s.get("train"), dict) and "grad_accum" in s["train"] for s in sources)


def choose(config: Config, world: int) -> tuple[Config, str | None]:
    """``config`` with the pipeline's micro-batches chosen for ``world`` ranks, and the sentence that says so
    (``None`` and ``config`` unchanged when nothing needs choosing: no pipeline, GPipe, or already enough
    micro-batches). Call only when the user did not set ``train.grad_accum`` (:func:`given`).

    Raises:
        ConfigError: an impossible layout (:meth:`Layout.from_config`).
    """
    p, t = config.parallel, config.train
    stages = p.pp * p.pp_stages_per_rank
    if p.pp == 1 or p.pp_schedule == "gpipe" or t.grad_accum >= stages or t.tokens_per_batch:
        return config, None
    layout = Layout.from_config(p, world)
    split = stages * layout.data_parallel * config.model.execution.bta_tiles
    what = (f"parallel.pp={p.pp} x pp_stages_per_rank={p.pp_stages_per_rank} with pp_schedule='{p.pp_schedule}' "
            f"needs >= {stages} micro-batches per step and train.grad_accum was not set: ")
    if t.batch_size % split == 0:
        chosen = replace(t, grad_accum=stages, batch_size=t.batch_size // stages)
        why = (f"train.grad_accum={stages}, train.batch_size={chosen.batch_size} (the step keeps its "
               f"{t.batch_size * t.grad_accum} sequences)")
    else:
        chosen = replace(t, grad_accum=stages)
        why = (f"train.grad_accum={stages}, train.batch_size={t.batch_size} (a step of {t.batch_size * stages} "
               f"sequences: {t.batch_size} do not split into {stages} micro-batches over {layout.data_parallel} "
               f"data-parallel rank(s) x {config.model.execution.bta_tiles} BTA tile(s))")
    return replace(config, train=chosen), what + why + "; set train.grad_accum to choose"
