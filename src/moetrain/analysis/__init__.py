"""Cost model: FLOPs, memory, arithmetic intensity and communication of an MoE training step, and a planner; one
module per concept (what each holds and how it is checked against the real model: docs/bta.md, "The cost model").
"""
