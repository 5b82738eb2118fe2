"""capture_regions: one graph per distinct block type, captured through the frontends and
checked against eager, reused for every repeat."""
