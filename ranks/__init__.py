"""One loop per role: the I/O shell around ``runtime/`` and ``models/`` on each rank."""
