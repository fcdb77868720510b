"""What a run prints and stores: the report, its JSON file and plots, the summary.
"""
