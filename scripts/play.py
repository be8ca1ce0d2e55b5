"""`make play`: start the 7-rank CPU server and the web gateway on this machine, print the page's URL, serve until
Ctrl-C.

    python scripts/play.py [--port 8080] [--token T] [--fast] [--section.key=value ...]

The synthetic backend's DiT is set to ``--denoise-s`` (default 0.7 s) per chunk of 12 frames so the stream runs at
about its media rate (16 fps), as the real model does on 7 H100s; ``--fast`` keeps the config's costs, and the
page then shows only the newest frames (the HUD counts the rest as dropped). Other ``--section.key=value``
arguments go to the server's config.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.local_gateway import LocalGateway
from scripts.local_server import ROOT, LocalServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="cpu-tiny")
    parser.add_argument("--port", type=int, default=8080, help="the page's port (0 picks a free one)")
    parser.add_argument("--token", help="access token the page must carry")
    parser.add_argument("--denoise-s", type=float, default=0.7, help="synthetic DiT seconds per chunk")
    parser.add_argument("--fast", action="store_true", help="keep the config's stage costs")
    args, overrides = parser.parse_known_args(argv)
    # Ctrl-C (and a plain kill) stops both, also when started where SIGINT is ignored (a background job of a script)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    pace = [] if args.fast else [f"--synthetic.denoise_s={args.denoise_s}"]
    (ROOT / "out").mkdir(exist_ok=True)
    print(f"starting the {args.config} server (7 ranks; about 15 s on two cores)…", flush=True)
    with LocalServer(args.config, pace + overrides, log_path=ROOT / "out" / "play-server.log") as server:
        gateway_args = ["--token", args.token] if args.token else []
        with LocalGateway(server.endpoint, args.port, gateway_args, log_path=ROOT / "out" / "play-gateway.log") as gw:
            url = gw.url + (f"?token={args.token}" if args.token else "")
            print(f"\n  open {url} in a browser (server {server.endpoint}; logs out/play-*.log)\n"
                  "  Ctrl-C stops both.\n", flush=True)
            try:
                while gw.process is not None and gw.process.poll() is None and server.process is not None \
                        and server.process.poll() is None:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                print("stopping…", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
