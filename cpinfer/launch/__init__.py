"""Starting ranks and running functions on them (SPMD): the engine's worlds, local or joined.

    driver process (the engine)                               rank processes
    ---------------------------                               --------------
    WorkerPool (pool.py) ---- pipes: call (fn, args, id) ----> worker_main (rank.py), ranks 1..N-1 (or 0..N-1)
      | watcher thread   <--- pipes: reply (id, rank, ..) --   |  gloo / NCCL world, FileStore rendezvous
      | DriverRank (driver.py): rank 0 in this process     <====+  (collectives between the ranks only)
      '-- CallBook (calls.py): the call id each rank's next reply must carry; a stale reply is dropped, logged

    InProcessWorld (inprocess.py): a world of one rank, this process, no message at all

    torchrun / --nnodes: every process is a rank of one world
    JoinedWorld (joined.py), rank 0 drives              JoinedWorld.serve_forever, ranks 1..N-1
      | broadcast mode: gloo control group  <========>    broadcast a call, gather its replies (with its id)
      '-- subset mode: RankLinks (control.py) <- TCP --> one connection each: framed pickles, length first
            reader thread files replies, worker thread runs rank 0's share

The public face: `WorkerPool`, `InProcessWorld`, `JoinedWorld` (all with `run`, `run_each`, `close`; the pool and
the subset-mode joined world also `run_some`, `submit_some`, `answered`, `wait_any`, `collect_some`, `abandon`),
`RankContext` (what a rank's function gets), `RemoteError` (a rank raised), `driver_can_host_rank`,
`joined_world_requested`, and the helpers other modules share (`free_port`, `describe_exit`,
`source_address_toward`, `set_parent_death_signal`, `leave_shutdown_to_driver`).
"""
from cpinfer.launch.common import (RankContext, RemoteError, describe_exit, free_port, heartbeat,
                                   joined_world_requested, loopback_interface)
from cpinfer.launch.control import control_address, source_address_toward
from cpinfer.launch.driver import driver_can_host_rank
from cpinfer.launch.inprocess import InProcessWorld
from cpinfer.launch.joined import JoinedWorld
from cpinfer.launch.pool import WorkerPool
from cpinfer.launch.rank import leave_shutdown_to_driver, set_parent_death_signal

__all__ = ["WorkerPool", "InProcessWorld", "JoinedWorld", "RankContext", "RemoteError", "driver_can_host_rank",
           "joined_world_requested", "free_port", "describe_exit", "loopback_interface", "heartbeat",
           "control_address", "source_address_toward", "set_parent_death_signal", "leave_shutdown_to_driver"]
