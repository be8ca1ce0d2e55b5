"""The web gateway: a play page in the browser, bridged to a worldstream server over ZeroMQ.

``python -m web --server tcp://127.0.0.1:5555`` serves ``web/static`` and bridges one WebSocket per browser tab to
the server with the project's ``AsyncClient``. Modules: ``page_protocol`` (what the page and the gateway say to
each other, validated), ``chunks`` (the one adapter that reads a chunk's applied control and facts), ``playout``
(which frame goes to the page next, and how it is encoded), ``bridge`` (one tab: its session, its pumps),
``tab_tasks`` (a tab's tasks, stopped together), ``gateway`` (the aiohttp app: routes, safety checks, limits),
``__main__`` (the command line).
"""
