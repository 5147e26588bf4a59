"""Benchmarks run by ``moetrain bench NAME``: one module per benchmark (see moetrain/commands/bench.py)."""


def add_measurement_args(p, json_default: str) -> None:
    """argparse options ``bench moe`` and ``bench train`` share: memory pass, threads, clock, seed, output file."""
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: elapsed time (default); cpu: process CPU time (steadier on a busy machine with "
                        "--threads 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=json_default, help=f"output file (default {json_default})")
