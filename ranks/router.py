"""``python -m ranks.router``: the router's command as scripts, Slurm recipes and docs spell it. The router is not a
rank: its program is ``router.shell`` (also ``python -m router``); this alias only keeps the old command working."""

import sys

from router.shell import main

if __name__ == "__main__":
    sys.exit(main())
