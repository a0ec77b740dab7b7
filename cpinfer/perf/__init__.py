"""Performance model, hardware/model catalogs, deployment planner (paper §3.4, App. A, C, D)."""
