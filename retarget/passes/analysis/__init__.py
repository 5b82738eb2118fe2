"""Analysis passes: find_blocks (the repeated blocks, by structural hashing of the module
tree) and annotate_shapes (shapes and FLOPs per module, from one probe forward)."""
