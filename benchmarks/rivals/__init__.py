"""The rivals the repository writes itself: the book's GPT in PyTorch.

PyTorch's own layers (nn.MultiheadAttention, scaled_dot_product_attention) are
set up by the workloads that time them.
"""
