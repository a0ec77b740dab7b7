"""Starting ranks and running functions on them (SPMD); the modules are being split out of `pool.py`."""
from cpinfer.launch.pool import (InProcessWorld, JoinedWorld, RankContext, RemoteError, WorkerPool,  # noqa: F401
                                 _set_parent_death_signal, control_address, describe_exit, driver_can_host_rank,
                                 free_port, heartbeat, joined_world_requested, leave_shutdown_to_driver,
                                 loopback_interface, source_address_toward)
