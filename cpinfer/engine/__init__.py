"""The serving engine: scheduler and sampling on the driver, SPMD workers that own model replicas and KV shards."""
