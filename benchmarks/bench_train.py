"""The same as ``moetrain bench train`` (moetrain/bench/train.py): ``python benchmarks/bench_train.py [options]``
(``--help`` lists them).

Prints a table and writes a JSON report; nothing is asserted (speed belongs here, not in tests).
"""

from __future__ import annotations

import sys

from moetrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "train", *sys.argv[1:]]))
