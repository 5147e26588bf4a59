"""Cost model: FLOPs, memory, arithmetic intensity and communication of an MoE training step, and a planner.

One concept per module: ``shape`` (the model's dimensions), ``flops``, ``params`` (parameter / gradient / optimizer
memory), ``activations`` (saved-activation memory, with BTA and checkpointing), ``intensity`` (tokens per expert
and the expert GEMMs' arithmetic intensity), ``comm`` (all-to-all, all-reduce and pipeline bytes), ``hardware``
(device presets with sourced peak figures, user files, CPU calibration), ``stages`` (pipeline stages balanced by
per-block cost, the split the trainer uses), ``step`` (step-time estimate of a layout),
``planner`` (candidate layouts and the recommendation); ``saved`` measures what autograd really saves.
"""
