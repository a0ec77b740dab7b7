"""Launch one engine over several nodes without torchrun: `--nnodes R --node-rank i --master-addr H --master-port P`.

The engine's world (every rank its parallel config counts) is split evenly over R nodes: node i runs the global
ranks [i·rpn, (i+1)·rpn), rpn = world / R. Every rank joins one torch.distributed world through a TCP store that
node 0's rank 0 hosts at H:P, then takes the same joined-world path as under torchrun (`launch.JoinedWorld`): on
node 0 this process is rank 0, the driver (it serves HTTP or runs the prompt), and the node's other ranks are its
child processes; the other nodes are headless: they start their ranks and wait until the driver ends the world.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from cpinfer.utils import get_logger

log = get_logger()

DEFAULT_MASTER_PORT = 29500  # torchrun's default rendezvous port
_REAP_S = 10.0  # how long a node waits for its ranks to leave a world that ended before it kills them
_CHILD_ENTRY = "from cpinfer.multinode import rank_main; raise SystemExit(rank_main())"


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """This node's place in a multi-node world; validates itself (every error names what is allowed)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    world_size: int  # every rank of the engine, all nodes together
    headless: bool = False

    def __post_init__(self):
        if not isinstance(self.nnodes, int) or self.nnodes < 2:
            raise ValueError(f"a multi-node world needs --nnodes >= 2, got {self.nnodes!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}: allowed "
                             f"0 .. {self.nnodes - 1}")
        if not self.master_addr:
            raise ValueError(f"--nnodes {self.nnodes} needs --master-addr HOST: the address of node 0, where its "
                             "rank 0 hosts the rendezvous (the same value on every node)")
        if not isinstance(self.master_port, int) or not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be in [1, 65535], got {self.master_port!r}")
        if self.world_size % self.nnodes:
            fits = [n for n in range(1, self.world_size + 1) if self.world_size % n == 0]
            raise ValueError(f"the engine's world has {self.world_size} ranks, which --nnodes {self.nnodes} does not "
                             f"divide: every node runs world / nnodes ranks (allowed --nnodes: "
                             f"{', '.join(map(str, fits))}), or change the parallel sizes")
        if self.node_rank == 0 and self.headless:
            raise ValueError("node 0 runs the driver (it serves HTTP or runs the prompt): leave --headless out on "
                             "--node-rank 0")
        if self.node_rank > 0 and not self.headless:
            raise ValueError(f"--node-rank {self.node_rank} runs ranks only, only node 0 serves: add --headless")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks of this node, in LOCAL_RANK order."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    @property
    def rendezvous(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def env(self, rank: int) -> dict[str, str]:
        """What torchrun would set for global rank `rank` of this node (read by `JoinedWorld` and the logger)."""
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank - self.local_ranks[0]),
                "LOCAL_WORLD_SIZE": str(self.ranks_per_node), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


# ---------------------------------------------------------------- the command line

def _port(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {text!r}")
    return value


def add_arguments(parser) -> None:
    """The "multi-node" flag group of `serve` and `generate`."""
    from cpinfer.bench.attention import positive_int

    g = parser.add_argument_group("multi-node", "one engine over several nodes without torchrun: run the same "
                                  "command on every node, with its own --node-rank (docs/multinode.md)")
    g.add_argument("--nnodes", type=positive_int, default=1, metavar="R",
                   help="nodes the engine's ranks are split over (evenly: world / nnodes ranks each, one GPU per "
                        "rank on CUDA)")
    g.add_argument("--node-rank", type=int, default=0, metavar="I",
                   help="this node's index in [0, nnodes); node 0 hosts the rendezvous and runs the driver")
    g.add_argument("--master-addr", default=None, metavar="HOST",
                   help="address of node 0, reachable from every node; node 0 binds the rendezvous (a TCP store) "
                        "to it, and every node's ranks use the interface through which it reaches it")
    g.add_argument("--master-port", type=_port, default=DEFAULT_MASTER_PORT, metavar="P",
                   help="TCP port of the rendezvous on node 0")
    g.add_argument("--headless", action="store_true",
                   help="nodes other than 0: run this node's ranks only (no HTTP, no prompt) and exit when the "
                        "driver on node 0 ends the world")


def spec_from_args(args, engine_kwargs: dict) -> NodeSpec | None:
    """This node's spec from the command line (None: one node, the local launcher). ValueError before anything
    starts; the world size is the engine's (`EngineConfig.parallel.world_size`), whatever roles it holds."""
    if args.nnodes == 1:
        if args.node_rank != 0 or args.headless:
            raise ValueError(f"--node-rank {args.node_rank}{' --headless' if args.headless else ''} needs "
                             "--nnodes >= 2 (one node runs every rank and serves)")
        return None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ValueError("--nnodes launches the ranks itself: under torchrun (RANK and WORLD_SIZE are set) leave "
                         "--nnodes, --node-rank, --master-addr, --master-port and --headless out")
    return NodeSpec(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                    world_size_of(engine_kwargs), args.headless)


def world_size_of(engine_kwargs: dict) -> int:
    """The ranks the engine will run with these keyword arguments (validated as the engine does): CP x TP, or with
    prefill / decode groups (N + K x M) x TP, the prefill group's ranks first."""
    from cpinfer.engine.config import EngineConfig

    kwargs = dict(engine_kwargs)
    decode_cp, groups = kwargs.pop("pd_decode_cp", None), kwargs.pop("pd_decode_groups", None)
    parallel = EngineConfig(**kwargs).parallel
    if decode_cp is None:
        if groups not in (None, 1):
            raise ValueError(f"pd_decode_groups ({groups}) needs pd_decode_cp (the decode groups' CP size)")
        return parallel.world_size
    from cpinfer.engine.pd import PDConfig

    return PDConfig(parallel.cp, decode_cp, 1 if groups is None else groups, parallel.tp).world_size


# ---------------------------------------------------------------- the network

def resolve_ipv4(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"--master-addr {host!r} does not resolve to an IPv4 address ({exc})") from None


def interface_toward(host: str) -> str | None:
    """The name of the network interface this node reaches `host` through ("lo" for 127.0.0.1), or None when it
    cannot be told (not Linux, no route)."""
    from cpinfer.launch import source_address_toward

    try:
        import fcntl
        import struct

        source = source_address_toward(resolve_ipv4(host))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                if socket.inet_ntoa(raw[20:24]) == source:
                    return name
    except (OSError, ValueError, ImportError):
        return None
    return None


def _bind_rendezvous(spec: NodeSpec) -> socket.socket:
    """Node 0: the rendezvous' listening socket, bound to --master-addr only (not every interface)."""
    addr = resolve_ipv4(spec.master_addr)
    if addr.startswith("127.") and not spec.master_addr.startswith("127.") and spec.master_addr != "localhost":
        log.warning("--master-addr %s resolves to %s (loopback) on node 0: other machines cannot reach the "
                    "rendezvous there; give node 0's network address (an IP) unless every node is this machine",
                    spec.master_addr, addr)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, spec.master_port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ValueError(f"node 0 cannot listen on {spec.rendezvous} for the rendezvous: {exc.strerror}; "
                         "--master-addr must be an address of node 0 and --master-port a free port") from None
    return sock


def _rank_environment(spec: NodeSpec, rank: int, threads: int | None) -> dict[str, str]:
    """Environment of one rank: torchrun's variables, the sockets on the interface toward node 0, and (on CPU) a
    share of the cores unless the user chose."""
    env = spec.env(rank)
    iface = interface_toward(spec.master_addr)
    if iface is not None:  # a user's choice in the environment wins
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", iface)
        env["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME", iface)
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.ranks_per_node))
    return env


def join_world(spec: NodeSpec, rank: int, engine_kwargs: dict, listen: socket.socket | None = None) -> None:
    """Join the world as `rank` (this process): its TCP store is hosted by rank 0 on `listen`, the socket bound to
    the master address. Afterwards `JoinedWorld` finds the default process group ready and uses it."""
    import torch
    import torch.distributed as dist

    from cpinfer.device import comm_backend, gpu_of_rank
    from cpinfer.engine.config import EngineConfig

    cfg = EngineConfig(**{k: v for k, v in engine_kwargs.items() if k not in ("pd_decode_cp", "pd_decode_groups")})
    backend = comm_backend(cfg.device, spec.ranks_per_node, cfg.share_gpus)
    if cfg.device == "cuda":
        torch.cuda.set_device(gpu_of_rank(rank - spec.local_ranks[0]))
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if listen is not None:  # rank 0: the store serves on the bound socket (its descriptor is the store's now)
        store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, True, timeout,
                              wait_for_workers=False, master_listen_fd=listen.detach())
    else:  # a client: retries until node 0 listens, up to the timeout
        store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.world_size, timeout=timeout)


# ---------------------------------------------------------------- the ranks of this node

class NodeRanks:
    """The rank processes this node starts (node 0: all but rank 0, which is this process; headless: all).

    Each is `python -c rank_main` with torchrun's variables; the model and engine arguments go in on stdin. A rank
    dies with this process (parent-death signal) and ignores SIGINT / SIGTERM (the driver ends the world).
    """

    def __init__(self, spec: NodeSpec, model: str, engine_kwargs: dict):
        self.spec = spec
        self.procs: dict[int, subprocess.Popen] = {}
        threads = engine_kwargs.get("threads_per_rank")
        payload = json.dumps({"model": model, "kwargs": engine_kwargs, "parent": os.getpid(), "spec":
                              dataclasses.asdict(spec)})
        first = 1 if spec.node_rank == 0 else spec.local_ranks[0]
        try:
            for rank in range(first, spec.local_ranks[-1] + 1):
                env = {**os.environ, **_rank_environment(spec, rank, threads)}
                p = subprocess.Popen([sys.executable, "-c", _CHILD_ENTRY], stdin=subprocess.PIPE, env=env)
                self.procs[rank] = p
                p.stdin.write(payload.encode())
                p.stdin.close()
        except BaseException:
            self.close(force=True)
            raise

    def exited(self) -> dict[int, int]:
        """Rank → exit code of the rank processes that have ended."""
        return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}

    def close(self, force: bool = False) -> None:
        """Wait (up to `_REAP_S`, unless forced) for the ranks to leave the ended world, then kill what is left."""
        deadline = time.monotonic() + (0.0 if force else _REAP_S)
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _describe(code: int) -> str:
    from cpinfer.launch import describe_exit

    return describe_exit(code)


def start_driver(spec: NodeSpec, model: str, engine_kwargs: dict) -> NodeRanks:
    """Node 0: bind the rendezvous, start this node's other ranks, and join the world as rank 0 (this process),
    failing fast if a local rank exits first. The engine built next joins this world as torchrun's rank 0 would.
    Close the returned ranks after the engine's shutdown."""
    listen = _bind_rendezvous(spec)  # before any process starts: a wrong address or a busy port fails here
    env = _rank_environment(spec, 0, engine_kwargs.get("threads_per_rank"))
    threads = env.pop("OMP_NUM_THREADS", None)
    os.environ.update(env)
    if threads is not None:
        import torch

        torch.set_num_threads(int(threads))
    log.info("multi-node: node 0 of %d runs ranks %d..%d (rank 0, the driver, is this process); rendezvous at %s "
             "for %d ranks", spec.nnodes, spec.local_ranks[0], spec.local_ranks[-1], spec.rendezvous,
             spec.world_size)
    ranks = NodeRanks(spec, model, engine_kwargs)
    box: list = []

    def join():
        try:
            join_world(spec, 0, engine_kwargs, listen)
            box.append(None)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            box.append(exc)

    joiner = threading.Thread(target=join, name="cpinfer-node-join", daemon=True)
    joiner.start()
    while joiner.is_alive():
        joiner.join(0.2)
        dead = ranks.exited()
        if dead and joiner.is_alive():
            ranks.close(force=True)
            rank, code = min(dead.items())
            raise RuntimeError(f"rank {rank} on this node exited ({_describe(code)}) before the world formed "
                               "(see its output above)")
    if box[0] is not None:
        ranks.close(force=True)
        raise RuntimeError(f"rank 0 could not form the world of {spec.world_size} ranks at {spec.rendezvous}: "
                           f"{box[0]}") from box[0]
    log.info("multi-node: all %d ranks joined at %s", spec.world_size, spec.rendezvous)
    return ranks


def run_headless(spec: NodeSpec, model: str, engine_kwargs: dict) -> int:
    """A node other than 0: start its ranks, wait until they leave the world. Exit code 0 when the driver ended
    the world, 1 when a rank failed (a peer or the driver died: the world is gone). A first SIGINT / SIGTERM is
    left to the driver (it ends the world); a second kills this node's ranks at once."""
    resolve_ipv4(spec.master_addr)
    for handler in log.handlers:  # this process is no rank: its lines name the node
        handler.setFormatter(logging.Formatter(f"[cpinfer node{spec.node_rank}] %(levelname)s %(message)s"))
    log.info("multi-node: node %d of %d (headless) runs ranks %d..%d; rendezvous at %s", spec.node_rank,
             spec.nnodes, spec.local_ranks[0], spec.local_ranks[-1], spec.rendezvous)
    signals: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _f: signals.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
    ranks = NodeRanks(spec, model, engine_kwargs)
    try:
        told = 0
        while True:
            exited = ranks.exited()
            failed = {r: c for r, c in exited.items() if c != 0}
            if failed:
                rank, code = min(failed.items())
                log.error("node %d: rank %d exited (%s): the world is gone (the driver or a rank of another node "
                          "ended, or this rank failed: see its output above)", spec.node_rank, rank, _describe(code))
                ranks.close()
                return 1
            if len(exited) == len(ranks.procs):
                log.info("node %d: the driver ended the world; every rank of this node exited", spec.node_rank)
                return 0
            if len(signals) > told:
                told = len(signals)
                if told >= 2:
                    log.warning("node %d: second %s: killing this node's ranks", spec.node_rank,
                                signal.Signals(signals[-1]).name)
                    ranks.close(force=True)
                    return 128 + signals[-1]
                log.warning("node %d: %s: waiting for the driver on node 0 to end the world (send it again to "
                            "kill this node's ranks now)", spec.node_rank, signal.Signals(signals[-1]).name)
            time.sleep(0.2)
    finally:
        ranks.close(force=True)
        for s, handler in previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------- one rank process

def _set_parent_death_signal(parent: int) -> None:
    """Die with the process that started this rank (Linux), also when it died before this call."""
    from cpinfer.launch import set_parent_death_signal as pdeathsig

    pdeathsig()
    if os.getppid() != parent:
        os._exit(1)


def rank_main() -> int:
    """Entry point of a rank process: join the world, then build the engine, which serves rank 0's calls until
    rank 0 ends the world (it exits this process with code 0)."""
    from cpinfer.launch import leave_shutdown_to_driver

    payload: dict[str, Any] = json.loads(sys.stdin.read())
    _set_parent_death_signal(payload["parent"])
    leave_shutdown_to_driver()
    spec = NodeSpec(**payload["spec"])
    rank = int(os.environ["RANK"])
    try:
        join_world(spec, rank, payload["kwargs"])
        from cpinfer.engine.pd import make_engine

        make_engine(payload["model"], **payload["kwargs"])  # serves rank 0's calls; returns only by SystemExit
    except Exception as exc:  # noqa: BLE001 - one clear line: the world ended under this rank, or it failed
        print(f"[cpinfer r{rank}] ERROR rank {rank} left the world: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        os._exit(1)  # now: tearing down a process group whose peer is gone may block or change the exit code
    return 1  # not reached: a rank other than 0 never gets an engine back
