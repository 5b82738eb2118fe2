"""Big-model inference: build a model without its weights, plan a device map, load a checkpoint."""
