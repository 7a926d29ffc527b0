"""``python -m mpips``: the command line (mpips/cli.py)."""

import sys

from .cli import main
from .process import signals

signals.command(sys.argv[1:])  # start-up over (for train: once its run begins)
sys.exit(main())
