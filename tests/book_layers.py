"""The book's chapter 3 attention layers, rebuilt in torch as test oracles.

"Build a Large Language Model (From Scratch)" (rasbt/LLMs-from-scratch,
ch03/01_main-chapter-code/ch03.ipynb) defines ``SelfAttention_v1`` (three
``nn.Parameter(torch.rand(d_in, d_out))``, used as ``x @ W``),
``SelfAttention_v2`` and ``CausalAttention`` (three ``nn.Linear(d_in, d_out,
bias=qkv_bias)``, scores scaled by ``1/sqrt(d_out)``; the causal one fills a
``mask`` buffer's upper triangle with -inf and applies ``nn.Dropout``) and
``MultiHeadAttention`` (the same projections split into heads of
``d_out // num_heads``, scaled by ``1/sqrt(head_dim)``, merged and passed
through ``out_proj = nn.Linear(d_out, d_out)``). Parameters are created in
that order, so that ``torch.manual_seed`` gives the book's weights.

:data:`PRINTED` holds the context vectors the notebook prints (4 decimals),
with the seed and arguments that produced them.

Importing this module does not import PyTorch: :func:`book_layers` takes it.
"""
import numpy as np

# The notebook's six-token sentence ("Your journey starts with one step").
INPUTS = np.array([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
                   [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]])

# name -> (seed, constructor arguments, batched input?, printed output (first batch item))
PRINTED = {
    "SelfAttention_v1": (123, (3, 2), False, [
        [0.2996, 0.8053], [0.3061, 0.8210], [0.3058, 0.8203],
        [0.2948, 0.7939], [0.2927, 0.7891], [0.2990, 0.8040]]),
    "SelfAttention_v2": (789, (3, 2), False, [
        [-0.0739, 0.0713], [-0.0748, 0.0703], [-0.0749, 0.0702],
        [-0.0760, 0.0685], [-0.0763, 0.0679], [-0.0754, 0.0693]]),
    "CausalAttention": (123, (3, 2, 6, 0.0), True, [
        [-0.4519, 0.2216], [-0.5874, 0.0058], [-0.6300, -0.0632],
        [-0.5675, -0.0843], [-0.5526, -0.0981], [-0.5299, -0.1081]]),
    "MultiHeadAttention": (123, (3, 2, 6, 0.0, 2), True, [
        [0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593],
        [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]]),
}


def book_layers(torch):
    """The four book classes, as a dict name -> ``nn.Module`` subclass."""
    nn = torch.nn

    class SelfAttention_v1(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.W_query = nn.Parameter(torch.rand(d_in, d_out))
            self.W_key = nn.Parameter(torch.rand(d_in, d_out))
            self.W_value = nn.Parameter(torch.rand(d_in, d_out))

        def forward(self, x):
            q, k, v = x @ self.W_query, x @ self.W_key, x @ self.W_value
            weights = torch.softmax(q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5, dim=-1)
            return weights @ v

    class SelfAttention_v2(nn.Module):
        def __init__(self, d_in, d_out, qkv_bias=False):
            super().__init__()
            self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

        def forward(self, x):
            q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
            weights = torch.softmax(q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5, dim=-1)
            return weights @ v

    class CausalAttention(nn.Module):
        def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
            super().__init__()
            self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.dropout = nn.Dropout(dropout)
            self.register_buffer(
                "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

        def forward(self, x):
            T = x.shape[1]
            q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
            scores = (q @ k.transpose(1, 2)).masked_fill(self.mask.bool()[:T, :T], -torch.inf)
            weights = self.dropout(torch.softmax(scores / k.shape[-1] ** 0.5, dim=-1))
            return weights @ v

    class MultiHeadAttention(nn.Module):
        def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
            super().__init__()
            self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
            self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.out_proj = nn.Linear(d_out, d_out)
            self.dropout = nn.Dropout(dropout)
            self.register_buffer(
                "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

        def forward(self, x):
            B, T, _ = x.shape

            def heads(y):  # (B, T, d_out) -> (B, H, T, head_dim)
                return y.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

            q, k, v = heads(self.W_query(x)), heads(self.W_key(x)), heads(self.W_value(x))
            scores = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:T, :T], -torch.inf)
            weights = self.dropout(torch.softmax(scores / k.shape[-1] ** 0.5, dim=-1))
            context = (weights @ v).transpose(1, 2).contiguous().view(B, T, self.d_out)
            return self.out_proj(context)

    return {"SelfAttention_v1": SelfAttention_v1, "SelfAttention_v2": SelfAttention_v2,
            "CausalAttention": CausalAttention, "MultiHeadAttention": MultiHeadAttention}
