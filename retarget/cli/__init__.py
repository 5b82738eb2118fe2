"""The `retarget` command: inspect, demo, launch, config, env, estimate-memory, device-map,
bench. The top of the stack: it may import every layer, and nothing imports it but __main__."""
