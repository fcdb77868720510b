"""What is timed: the grid of shapes, the attention workloads, the training steps
and the GPT, each with one runner per library.
"""
