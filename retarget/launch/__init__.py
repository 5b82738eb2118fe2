"""`retarget launch`: settings from flags and config files, the config questions, the torchrun
launcher and the per-rank worker, the environment report."""
