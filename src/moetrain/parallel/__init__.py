"""Expert parallelism on ``torch.distributed``: a DP x EP device mesh, expert sharding, all-to-all and all-gather
token dispatchers, gradient synchronisation, distributed checkpoints and the ``torchrun`` launcher.

Model code stays single-device: :func:`moetrain.parallel.launch.parallelize` attaches a dispatcher to every MoE
layer and replaces its expert weights by this rank's shard. Importing this package is cheap (no process group is
created until :func:`moetrain.parallel.mesh.init_distributed` is called).
"""
