"""Distributed training on ``torch.distributed``: one engine, FSDP2 on a ``pp x dp_replicate x dp_shard x ep``
``DeviceMesh`` (plain data parallelism, ZeRO, expert parallelism, pipelining on top), expert sharding, all-to-all
and all-gather token dispatchers, distributed checkpoints and the ``torchrun`` launcher.

Model code stays single-device: :func:`moetrain.parallel.launch.parallelize` attaches a dispatcher to every MoE
layer and replaces its expert weights by this rank's shard. Importing this package is cheap (no process group is
created until :func:`moetrain.parallel.launch.start` is called).
"""
