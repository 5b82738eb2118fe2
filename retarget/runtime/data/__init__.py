"""Data for many processes: epoch plans (`sharding.py`), the sharded loader, dispatch from rank
0, facts about a user's DataLoader, and the resumable loader."""
