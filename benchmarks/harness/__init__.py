"""How a run measures: timing protocols, worker processes, the cross-check, the
machine's peaks, peak memory and import cost; and one run's plan (bench).
"""
