"""`python -m asyncrl ...`: the `asyncrl` command (asyncrl/cli.py)."""

import sys

from asyncrl.cli import main

sys.exit(main())
