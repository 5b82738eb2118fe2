"""What a compile did, for people: the report table and dict (`summary.py`), graph renderings
(`render.py`: text, JSON, HTML; `dot_figure.py`: DOT/SVG; from `graph_history.py` and
`module_decisions.py`), the distribution plan as text (`plan_text.py`), the memory estimate
(`memory_estimate.py`). Reads the Program; changes nothing.

Layer: above bigmodel, runtime and passes (it reads their records); below the driver.
"""
