"""Training state on disk: checkpoint folders (atomic, with a manifest), the state codec, RNG
states, and `save_model` (safetensors shards). Part of the runtime layer."""
