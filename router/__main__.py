"""``python -m router --config configs/router/router.toml``: the router process (``router.shell``)."""

import sys

from router.shell import main

sys.exit(main())
