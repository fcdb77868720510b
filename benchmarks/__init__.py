"""qkvnp's benchmarks, beside the package and not in it: the commands here, their parts below.

harness: how a run measures; workloads: what is timed; rivals: what qkvnp is set
against that the repository writes itself; reports: what a run prints and stores.
README.md describes each command.
"""
