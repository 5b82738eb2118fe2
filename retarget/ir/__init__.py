"""The compiler's IR: the Program that flows through the passes, and the Regions that hold the
captured graphs (one per block type and call signature)."""
