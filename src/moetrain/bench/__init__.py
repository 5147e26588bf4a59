"""Benchmarks run by ``moetrain bench NAME``: one module per benchmark (see moetrain/commands/bench.py)."""

from moetrain.errors import ConfigError


def add_measurement_args(p, json_default: str) -> None:
    """argparse options ``bench moe`` and ``bench train`` share: device, memory pass, threads, clock, seed, output
    file."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where every candidate runs (default cpu); on cuda the timings synchronise the device")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: elapsed time (default); cpu: process CPU time (steadier on a busy machine with "
                        "--threads 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=json_default, help=f"output file (default {json_default})")


def check_device(device: str) -> None:
    """Raises ConfigError for ``--device cuda`` when PyTorch sees no CUDA device."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this PyTorch sees no CUDA device (torch.cuda.is_available() is False)")
