"""``python -m moetrain`` (also what ``torchrun -m moetrain`` runs)."""

import sys

from moetrain.cli import main

sys.exit(main())
