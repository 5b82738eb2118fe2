"""The `retarget` command: inspect, demo, launch, config, env, estimate-memory, bench."""
