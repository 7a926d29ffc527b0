"""``python -m mpips``: the command line (mpips/cli.py)."""

import signal
import sys

from .cli import main

if sys.argv[1:2] != ["train"]:  # (train keeps the quiet Ctrl-C until it installs its own)
    signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(main())
