"""compile_regions: torch.compile of each region's final graph, once per block type (its
compiled runners are the execution layer's: execution/compiled_calls.py, flat_calls.py)."""
