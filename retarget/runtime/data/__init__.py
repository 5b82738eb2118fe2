"""Data for many processes: epoch plans (`sharding.py`), the sharded loader, dispatch from rank
0, facts about a user's DataLoader, the resumable loader, the XLA upload path. Part of the
runtime layer."""
