"""``python -m megakern.train``: the console script megakern-train."""
import sys

from megakern.train.cli import main

sys.exit(main())
