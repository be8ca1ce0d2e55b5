"""The router program: the I/O shell around the router core (``router.shell``, ``python -m router``) and a replica's
registration with its router (``router.registration``, a thread on a replica's rank 0). Not ranks: the router is
its own process in front of whole jobs, and its rules live in ``runtime.router`` and its parts."""
