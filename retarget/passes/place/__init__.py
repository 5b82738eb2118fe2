"""Placement: where weights live. place_xla (the XLA devices, SPMD shards), plan_stream
(inference weights brought in per block), and the device-map planner they and bigmodel use
(`device_map.py`: infer_auto_device_map, `activation_headroom.py`)."""
