"""What a compile did, for people: the report table and dict (`summary.py`), graph renderings
(`render.py`), the distribution plan as text (`plan_text.py`), the memory estimate
(`memory_estimate.py`). Reads the Program; changes nothing."""
