"""The same as ``moetrain bench moe`` (moetrain/bench/moe.py): ``python benchmarks/bench_moe.py [options]``
(``--help`` lists them).

Prints a table and writes a JSON report; nothing is asserted (speed belongs here, not in tests).
"""

from __future__ import annotations

import sys

from moetrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "moe", *sys.argv[1:]]))
