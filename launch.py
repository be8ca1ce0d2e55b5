"""Entry point: ``torchrun --nproc-per-node N launch.py --config configs/X.toml [--section.key=value ...]``.

Run without a torchrun (or ``srun``) environment, ``python launch.py --config X`` starts a local torchrun with
the layout's world size itself and forwards SIGINT/SIGTERM to rank 0, which shuts every rank down cleanly; a stop
asked that way exits 0 (in an ``sbatch`` script, ``salloc`` or ``srun --pty`` too: see ``distributed_env``).
Under torchrun, each rank reads RANK/WORLD_SIZE/LOCAL_RANK (or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID for a direct
``srun -n <world size>`` launch), joins the process group (NCCL with CUDA, bound to its device, else gloo), creates
every process group in a fixed order and makes each group's communicator at once (``handshake``), builds its stages,
waits for every rank to have built (``timeouts.startup_s``), then starts its role threads: each stage thread warms
its stage up at every served frame size (``ranks.warmup``) on its own stream before its hello tells rank 0 it is
ready, and the rank's room is measured once all of them have. The ranks load CUDA modules eagerly
(``CUDA_MODULE_LOADING=EAGER``) and the allocator uses expandable segments, unless the user set them. Exit codes: 0
after a clean shutdown (a requested stop included), non-zero when any rank died or hung (the recipes in scripts/slurm/
requeue the job on it).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
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
from runtime import cli_help, logs
from runtime import config as config_mod

if TYPE_CHECKING:  # torch and zmq load only in the ranks, not in the self-launching parent
    from ranks.coordinator import Coordinator
    from ranks.worker import RankContext

log = logging.getLogger("worldstream")

EXIT_START_FAILED = 1  # a rank did not build its stages within timeouts.startup_s


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options (``runtime.cli_help``: its ``--help`` lists the configs, sections and keys) and the overrides."""
    parser = cli_help.build_parser()
    args, overrides = parser.parse_known_args(argv)
    return args, overrides


NOT_A_STEP = 0xFFFFFFF0  # Slurm's batch, extern and interactive "steps" carry ids from here up: not an srun launch


def distributed_env(world_size: int, env: MutableMapping[str, str] | None = None
                    ) -> tuple[tuple[int, int, int] | None, str]:
    """(rank, world size, local rank) from torchrun, or from Slurm for a direct ``srun``; None to self-launch; and
    why, for the log. An ``sbatch`` script, ``salloc`` or ``srun --pty`` also sets SLURM_PROCID=0 and SLURM_NTASKS
    (the batch script has no SLURM_STEP_ID, an interactive step has one task): only an srun step with as many tasks
    as the layout has ranks is a rank launch; anything else starts a local torchrun, the one path whose requested
    stop exits 0."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return (int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))), "torchrun"
    if "SLURM_PROCID" not in env and "SLURM_JOB_ID" not in env:
        return None, "no torchrun or Slurm environment: starting torchrun here"
    step = env.get("SLURM_STEP_ID", "")
    tasks = env.get("SLURM_NTASKS", "")
    if step.isdigit() and int(step) < NOT_A_STEP and tasks == str(world_size) and "SLURM_PROCID" in env:
        env.setdefault("MASTER_ADDR", "127.0.0.1")  # the batch file sets the first node of the allocation
        env.setdefault("MASTER_PORT", "29512")
        return ((int(env["SLURM_PROCID"]), world_size, int(env.get("SLURM_LOCALID", "0"))),
                f"srun step {env.get('SLURM_JOB_ID', '?')}.{step} of {tasks} tasks")
    where = f"step {step}" if step else "the batch script or allocation (no SLURM_STEP_ID)"
    return None, (f"inside Slurm job {env.get('SLURM_JOB_ID', '?')}, {where} with SLURM_NTASKS={tasks or 'unset'}, "
                  f"not an srun step of the layout's {world_size} tasks: starting torchrun here")


# What the ranks' CUDA runtime and allocator are told, unless the user set the variable (then it is logged: an
# inherited CUDA_MODULE_LOADING=LAZY from a shell profile would otherwise silently bring the hazard back).
# - CUDA_MODULE_LOADING=EAGER: every kernel module loads when CUDA initialises. Lazy loading (the driver default since
#   CUDA 12.2) loads a module at its kernel's first launch, which may wait for the device to drain: behind an NCCL
#   receive spinning on the same GPU (another role thread's), a hang in the co-located layouts.
# - PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching allocator pools blocks per stream, and every role
#   thread has its own (``ipc.streams``); with fixed segments a block cached by one stream is unusable to another
#   and memory fragments across them, so the room a rank measured (``ranks.memory``) would not all be usable.
# - NCCL_RUNTIME_CONNECT=0: NCCL (2.22 on) otherwise connects a communicator's channels and allocates their buffers
#   at each kind of operation's first use (the first real broadcast, latent or frames send), after each rank
#   measured its room; connected at creation, those buffers are in place when the room is measured.
RANK_ENV = {"CUDA_MODULE_LOADING": "EAGER", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "NCCL_RUNTIME_CONNECT": "0"}


def rank_environment(env: MutableMapping[str, str], say: bool = True) -> None:
    """Set ``RANK_ENV`` in ``env`` where the user did not choose; log where they did. CUDA reads these when it
    initialises, so this runs before any rank touches CUDA (and torchrun's ranks inherit them)."""
    for name, value in RANK_ENV.items():
        if name not in env:
            env[name] = value
        elif env[name] != value and say:
            log.warning("%s=%s is set in the environment: kept (worldstream would set %s)", name, env[name], value)


def self_launch(args: argparse.Namespace, overrides: list[str], world_size: int) -> int:
    """Start a local torchrun with the layout's world size; forward SIGINT/SIGTERM to rank 0. A requested stop exits
    0 when rank 0 shut down cleanly, whatever torchrun says: under Slurm the stop signal reaches every process of
    the step (``proctrack`` signals them all), torchrun's own handler then exits 1 though every rank ended well."""
    with tempfile.TemporaryDirectory(prefix="worldstream-") as run_dir:
        pid_file = Path(run_dir) / "rank0.pid"
        env = {**os.environ, "WORLDSTREAM_PIDFILE": str(pid_file)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={world_size}", "--monitor-interval=0.2",
                   str(Path(__file__).resolve()), "--config", args.config, "--log-level", args.log_level,
                   "--log-format", args.log_format, *overrides]
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
            return stopped_code(code, exit_file(pid_file))
        return code


def exit_file(pid_file: Path | str) -> Path:
    """Where rank 0 writes its exit code, beside its pid file: how a launcher tells a clean stop from a failure."""
    return Path(f"{pid_file}.exit")


def stopped_code(torchrun_code: int, rank0_exit: Path) -> int:
    """The exit code of a launcher asked to stop: 0 when rank 0 shut down cleanly (or never started serving, so there
    was nothing to lose); torchrun's code when rank 0 itself failed."""
    try:
        rank0 = int(rank0_exit.read_text())
    except (OSError, ValueError):
        log.warning("stopped before rank 0 served (torchrun exited %d): exit 0", torchrun_code)
        return 0
    if rank0 == 0:
        log.info("stopped: rank 0 shut down cleanly (torchrun exited %d after the stop): exit 0", torchrun_code)
        return 0
    log.warning("rank 0 exited %d while stopping: exit %d", rank0, torchrun_code)
    return torchrun_code


def run_rank(args: argparse.Namespace, overrides: list[str], rank: int, world: int, local_rank: int) -> int:
    import torch
    import torch.distributed as dist
    import zmq

    from ipc import transport
    from ipc.protocol import Stage
    from ipc.streams import RoleStreams
    from ipc.tensor_plane import build_groups, handshake
    from models import precision
    from ranks import backend as backend_mod
    from ranks import memory, roles
    from ranks.warmup import StartGate, stages_of
    from ranks.worker import RankContext, run_thread
    from runtime.placement import STAGES, group_members, placement_of
    from runtime.sizes import served_sizes

    cfg = config_mod.load(args.config, overrides)
    if cfg.replica.name:  # each line names the replica from now on
        logs.configure("rank", args.log_level, args.log_format, rank=rank, replica=cfg.replica.name)
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
    # device_id binds the rank to its GPU: NCCL makes each communicator when its group is created (all ranks are
    # there together), not at its first use by some role thread mid-session
    dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    groups = build_groups(group_members(lay), lay.world_size, backend, cfg.timeouts.collective_s, device)
    # every rank waits here for the slowest to build its stages (umT5-XXL and a VAE before a DiT on some ranks):
    # gloo, with the start-up deadline, not the collective one the first DiT collective would otherwise time out on
    start_group = dist.new_group(list(range(world)), timeout=timedelta(seconds=cfg.timeouts.startup_s),
                                 backend="gloo")
    log.info("rank %d: communicators made, in order: %s", rank, ", ".join(handshake(groups)))
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
    built = backend_mod.build(cfg.model, cfg.stream, cfg.synthetic, cfg.controls, rank_roles, device,
                              groups.named(STAGES[Stage.DENOISE].group))
    if device.type == "cuda":  # the weights were written on the legacy default stream; the role streams don't wait
        torch.cuda.synchronize(device)
    began = time.monotonic()
    try:
        dist.monitored_barrier(group=start_group, timeout=timedelta(seconds=cfg.timeouts.startup_s),
                               wait_all_ranks=True)
    except RuntimeError as error:
        log.error("job failed: %s", late_ranks(str(error), lay, cfg.timeouts.startup_s))
        return EXIT_START_FAILED
    log.info("rank %d: built; every rank was built %.2f s later", rank, time.monotonic() - began)
    start = StartGate(stages_of(built))
    ctx = RankContext(layout=lay, timeouts=cfg.timeouts, rank=rank, roles=rank_roles, endpoint=shared[0],
                      zmq=context, groups=groups, backend=built, streams=RoleStreams(device),
                      sizes=served_sizes(cfg.stream), start=start,
                      check_memory=lambda *args: memory.check_later(cfg, rank, *args),
                      snapshots_dir=cfg.snapshots.dir)
    coordinator = None
    if rank == lay.coordinator:  # before any worker thread: a fatal error on this rank reaches clients first
        from ranks.coordinator import Coordinator

        coordinator = Coordinator(ctx, cfg, clients, workers)
        ctx.on_fatal = lambda message: setattr(coordinator, "fatal", message)
        if cfg.replica.router:  # a replica of a router: register this job's client endpoint there (and beat)
            from router.registration import start_registration

            start_registration(cfg.replica, cfg.server, port, lay.name, context, ctx.stop)
    threads = []
    began = time.monotonic()
    # The stage threads warm their stages up (``ranks.warmup``); the RNG state is restored once all did, before any
    # session. No thread says hello before the rank's room is measured (``StartGate``).
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for role in placement_of(lay).threads_on(rank):  # the stage table's threads of this rank
            work = roles.THREADS[role]
            threads.append(run_thread(ctx, role, lambda work=work: work(ctx)))
        warmed = start.wait_warm(ctx.stop)
    failed = [f"{w.stage} {w.height}x{w.width}" for w in warmed or () if w.failed]
    log.info("rank %d: warm in %.2f s (%d stage runs%s)", rank, time.monotonic() - began, len(warmed or ()),
             f"; not served here: {', '.join(failed)}" if failed else "")
    ctx.room = memory.room_bytes(cfg, rank, device)  # after the weights and every stage thread's warm-up
    start.ready.set()  # the hellos go, with the room
    if coordinator is not None:
        return run_coordinator(ctx, coordinator, port)
    ignore_stop_signals()
    for thread in threads:
        while thread.is_alive():
            thread.join(timeout=0.5)
    log.info("rank %d: clean exit", rank)
    return 0


def late_ranks(error: str, layout: config_mod.LayoutConfig, startup_s: float) -> str:
    """What a failed start-up barrier says: on rank 0 (which ``monitored_barrier`` tells) the late ranks and their
    roles; elsewhere that rank 0 names them."""
    found = re.search(r"Ranks? ([\d, ]+) failed to pass", error)
    if found is None:
        return (f"not every rank built its stages within {startup_s:.0f} s (timeouts.startup_s); rank 0's log "
                f"names the late ones ({error.strip().splitlines()[0] if error.strip() else 'no detail'})")
    late = [int(r) for r in found.group(1).replace(",", " ").split()]
    named = ", ".join(f"rank {r} ({', '.join(layout.roles_of(r))})" for r in late)
    return f"{named} did not finish building its stages within {startup_s:.0f} s (timeouts.startup_s)"


def ignore_stop_signals() -> None:
    """Workers ignore SIGINT/SIGTERM: rank 0 orders the shutdown (a Ctrl-C reaches every rank at once)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_coordinator(ctx: RankContext, coordinator: Coordinator, port: int) -> int:
    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: %s", signum, coordinator.signalled())  # the loop wakes within its poll interval

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    pid_file = os.environ.get("WORLDSTREAM_PIDFILE")
    if pid_file:
        Path(pid_file).write_text(str(os.getpid()))
    log.info("client port tcp://%s:%d (serving once every rank reported in)", coordinator.server.host, port)
    code = coordinator.run(port)
    ctx.stop.set()
    time.sleep(0.2)  # let the last messages to clients leave
    if pid_file:  # the launcher (launch.py, a recipe's trap) tells a clean stop from a failure by it
        exit_file(pid_file).write_text(str(code))
    return code


def refuse_elastic_restarts(env: MutableMapping[str, str]) -> None:
    """``torchrun --max-restarts``: on torch 2.13 a restarted rank cannot re-join through the agent's shared TCP
    store (its gloo groups time out at re-init), unless the agent does not share it. Refused here, before any rank
    joins, rather than hang at the first restart."""
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        raise config_mod.ConfigError(
            f"torchrun --max-restarts={restarts} needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
            "environment (restarted ranks cannot re-join its shared store on torch 2.13); set it, or run with "
            "--max-restarts=0 and let Slurm requeue the job (scripts/slurm/, docs/slurm.md)")


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.print_config or args.check:
        return cli_help.run_offline(args, overrides)
    logs.configure("launcher", args.log_level, args.log_format)
    try:
        cfg = config_mod.load(args.config, overrides)
        env, why = distributed_env(cfg.layout.world_size)
        if env is not None:  # a rank: its own name in every line
            logs.configure("rank", args.log_level, args.log_format, rank=env[0])
        # before torch initialises CUDA, in the ranks and in torchrun's environment; a user's choice said once
        rank_environment(os.environ, say=env is None or env[0] == 0)
        if env is None:
            log.info("%s", why)
            if cfg.model.checkpoint_dir:  # a folder the ranks cannot load from: exit 2 here, not 1 from torchrun
                cli_help.check(cfg, args.config)  # (a Slurm recipe requeues 1, never 2)
            return self_launch(args, overrides, cfg.layout.world_size)
        if env[0] == 0:
            log.info("launched by %s", why)
        refuse_elastic_restarts(os.environ)
        # @record: an exception on a rank reaches torchrun's failure summary with its traceback
        from torch.distributed.elastic.multiprocessing.errors import record

        code = record(run_rank)(args, overrides, *env)
    except config_mod.ConfigError as error:
        log.error("%s", error)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never wait on a peer at interpreter exit: the job's fate is decided


if __name__ == "__main__":
    sys.exit(main())
