"""Placement for inference: which weights stay resident and which are brought in per block."""
