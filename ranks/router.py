"""``python -m ranks.router``: the router's command as scripts, Slurm recipes and docs spell it. The router is not a
rank: its program is ``router.shell`` (also ``python -m router``); this alias only keeps the old command working.
It runs ``python -m router`` as that command would, rather than importing it: the router stands above the ranks
(it reuses ``ranks.probe_server``), and nothing in ``ranks/`` imports it."""

import runpy

if __name__ == "__main__":
    runpy.run_module("router", run_name="__main__")
