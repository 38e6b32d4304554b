"""`toolkit quantize`: orchestration and quality evaluation (the graph rewrite is exporters/quantize.py)."""
