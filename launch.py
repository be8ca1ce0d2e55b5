"""Entry point: ``torchrun --nproc-per-node N launch.py --config configs/X.toml [--section.key=value ...]``.

Run without a torchrun (or ``srun``) environment, ``python launch.py --config X`` starts a local torchrun with
the layout's world size itself and forwards SIGINT/SIGTERM to rank 0, which shuts every rank down cleanly.
Under torchrun, each rank reads RANK/WORLD_SIZE/LOCAL_RANK (or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID for a
direct ``srun`` launch), joins the process group (NCCL with CUDA, else gloo), creates every process group in a
fixed order, warms every stage up at every frame size the server serves (``ranks.warmup``) and only then runs the
loops of its roles (whose hellos tell rank 0 the rank is ready). CUDA modules load eagerly in the ranks
(``CUDA_MODULE_LOADING=EAGER`` unless set). Exit codes: 0 after a clean shutdown, non-zero when any rank
died or hung (so Slurm can requeue).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from ranks.processes import die_with_parent
from runtime import config as config_mod

if TYPE_CHECKING:  # torch and zmq load only in the ranks, not in the self-launching parent
    from ranks.coordinator import Coordinator
    from ranks.worker import RankContext

log = logging.getLogger("worldstream")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a TOML file, or a name from configs/ (cpu-tiny, ...)")
    parser.add_argument("--log-level", default=os.environ.get("WORLDSTREAM_LOG", "INFO"))
    args, overrides = parser.parse_known_args(argv)
    return args, overrides


def distributed_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun, or from Slurm for a direct ``srun``; None when neither."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env.setdefault("MASTER_ADDR", "127.0.0.1")  # the batch file sets the first node of the allocation
        env.setdefault("MASTER_PORT", "29512")
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0"))
    return None


def eager_module_loading(env: MutableMapping[str, str]) -> None:
    """Load every CUDA kernel module when CUDA initialises, unless the user chose otherwise. Lazy loading (the driver
    default since CUDA 12.2) loads a module at its kernel's first launch, which may wait for the device to drain: behind
    an NCCL receive spinning on the same GPU (another role thread's), a hang in the co-located layouts. CUDA reads it
    when it initialises, so it is set before any rank touches CUDA (and inherited by torchrun's ranks)."""
    env.setdefault("CUDA_MODULE_LOADING", "EAGER")


def self_launch(args: argparse.Namespace, overrides: list[str]) -> int:
    """Start a local torchrun with the layout's world size; forward SIGINT/SIGTERM to rank 0."""
    cfg = config_mod.load(args.config, overrides)
    with tempfile.TemporaryDirectory(prefix="worldstream-") as run_dir:
        pid_file = Path(run_dir) / "rank0.pid"
        env = {**os.environ, "WORLDSTREAM_PIDFILE": str(pid_file)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={cfg.layout.world_size}", "--monitor-interval=0.2",
                   str(Path(__file__).resolve()), "--config", args.config, "--log-level", args.log_level, *overrides]
        # torchrun dies with this launcher (and every rank with torchrun): a killed launcher leaves no orphans
        child = subprocess.Popen(command, env=env, start_new_session=True,
                                 preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        stop_requested = False

        def forward(signum: int, _frame: object) -> None:
            nonlocal stop_requested
            stop_requested = True
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                os.killpg(child.pid, signal.SIGTERM)  # rank 0 not up yet: stop everything

        signal.signal(signal.SIGINT, forward)
        signal.signal(signal.SIGTERM, forward)
        code = child.wait()
        if stop_requested and code != 0:
            log.warning("torchrun exited with %d after the stop request", code)
        return code


def run_rank(args: argparse.Namespace, overrides: list[str], rank: int, world: int, local_rank: int) -> int:
    import torch
    import torch.distributed as dist
    import zmq

    from ipc import transport
    from ipc.streams import RoleStreams
    from ipc.tensor_plane import build_groups
    from models import precision
    from ranks import backend as backend_mod
    from ranks import memory, roles
    from ranks.warmup import warm_up
    from ranks.worker import RankContext, heartbeat, run_thread
    from runtime.sizes import served_sizes

    cfg = config_mod.load(args.config, overrides)
    lay = cfg.layout
    # No rank outlives its launcher (torchrun's agent, srun's step): rank 0 shuts down cleanly, the others go at once.
    die_with_parent(signal.SIGTERM if rank == lay.coordinator else signal.SIGKILL)
    if world != lay.world_size:
        raise config_mod.ConfigError(f"{args.config}: layout.world_size is {lay.world_size} but the launcher "
                                     f"started {world} ranks (torchrun --nproc-per-node / srun --ntasks)")
    use_cuda = torch.cuda.is_available() and lay.backend != "gloo"
    backend = "nccl" if (lay.backend == "nccl" or (lay.backend == "auto" and use_cuda)) else "gloo"
    if backend == "nccl":
        index = local_rank % torch.cuda.device_count()  # srun --gpus-per-task=1 shows each task one GPU
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        torch.set_num_threads(1)  # seven ranks on two cores: one thread each
        device = torch.device("cpu")
    timeout = timedelta(seconds=cfg.timeouts.collective_s)
    dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    groups = build_groups(lay, backend, cfg.timeouts.collective_s, device)
    context = zmq.Context()
    clients = workers = None
    port = 0
    if rank == lay.coordinator:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        workers, endpoint = transport.worker_router(context, "127.0.0.1" if host == "localhost" else host)
        clients, port = transport.client_router(context, cfg.server.host, cfg.server.port, cfg.server.send_hwm,
                                                cfg.server.max_message_bytes)
        shared = [endpoint]
    else:
        shared = [None]
    dist.broadcast_object_list(shared, src=lay.coordinator, group=groups.control)
    rank_roles = lay.roles_of(rank)
    precision.apply(device, cfg.model.vae_dtype, holds_vae=bool({"condition", "decode"} & set(rank_roles)))
    built = backend_mod.build(cfg.model, cfg.stream, cfg.synthetic, cfg.controls, rank_roles, device, groups.dit)
    if device.type == "cuda":  # the weights were written on the legacy default stream; the role streams don't wait
        torch.cuda.synchronize(device)
    streams = RoleStreams(device)
    started = time.monotonic()
    warmed = warm_up(built, served_sizes(cfg.stream), device, streams)  # before any thread: the rank is not ready yet
    log.info("rank %d: warm in %.2f s (%d stage runs)", rank, time.monotonic() - started, len(warmed))
    room = memory.room_bytes(cfg, rank, device)  # after the weights and the warm-up: what sessions may take
    ctx = RankContext(layout=lay, timeouts=cfg.timeouts, rank=rank, roles=rank_roles, endpoint=shared[0],
                      zmq=context, groups=groups, backend=built, streams=streams, warm_up=warmed, room=room,
                      check_memory=lambda *args: memory.check_later(cfg, rank, *args),
                      snapshots_dir=cfg.snapshots.dir)
    coordinator = None
    if rank == lay.coordinator:  # before any worker thread: a fatal error on this rank reaches clients first
        from ranks.coordinator import Coordinator

        coordinator = Coordinator(ctx, cfg, clients, workers)
        ctx.on_fatal = lambda message: setattr(coordinator, "fatal", message)
        if cfg.replica.router:  # a replica of a router: register this job's client endpoint there (and beat)
            from ranks.registration import start_registration

            start_registration(cfg.replica, cfg.server, port, lay.name, context, ctx.stop)
    threads = []
    if "condition" in rank_roles:
        threads.append(run_thread(ctx, "condition", lambda: roles.condition_worker(ctx)))
    if rank == lay.condition or rank in lay.dit:
        threads.append(run_thread(ctx, "condition_edge", lambda: roles.condition_edge(ctx)))
    if "denoise" in rank_roles:
        threads.append(run_thread(ctx, "denoise", lambda: roles.denoise_worker(ctx)))
    if "decode" in rank_roles:
        threads.append(run_thread(ctx, "decode", lambda: roles.decode_worker(ctx)))
        if rank != lay.dit_leader:
            threads.append(run_thread(ctx, "latent_receiver", lambda: roles.latent_receiver(ctx)))
    if coordinator is not None:
        if lay.decode != rank:
            threads.append(run_thread(ctx, "frames", lambda: roles.frames_receiver(ctx)))
        return run_coordinator(ctx, coordinator, port)
    threads.append(run_thread(ctx, "heartbeat", lambda: heartbeat(ctx)))
    ignore_stop_signals()
    for thread in threads:
        while thread.is_alive():
            thread.join(timeout=0.5)
    log.info("rank %d: clean exit", rank)
    return 0


def ignore_stop_signals() -> None:
    """Workers ignore SIGINT/SIGTERM: rank 0 orders the shutdown (a Ctrl-C reaches every rank at once)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_coordinator(ctx: RankContext, coordinator: Coordinator, port: int) -> int:
    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        coordinator.stopping = True  # the loop wakes within its poll interval

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    pid_file = os.environ.get("WORLDSTREAM_PIDFILE")
    if pid_file:
        Path(pid_file).write_text(str(os.getpid()))
    log.info("client port tcp://%s:%d (serving once every rank reported in)", coordinator.server.host, port)
    code = coordinator.run(port)
    ctx.stop.set()
    time.sleep(0.2)  # let the last messages to clients leave
    return code


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    eager_module_loading(os.environ)  # before torch initialises CUDA, in the ranks and in torchrun's environment
    env = distributed_env()
    rank = env[0] if env else None
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {'launcher' if rank is None else f'rank{rank}'} %(levelname)s "
                               "%(name)s: %(message)s")
    try:
        if env is None:
            return self_launch(args, overrides)
        code = run_rank(args, overrides, *env)
    except config_mod.ConfigError as error:
        log.error("%s", error)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never wait on a peer at interpreter exit: the job's fate is decided


if __name__ == "__main__":
    sys.exit(main())
