"""The book's GPT (chapter 4) in PyTorch, with a KV cache for decoding: the benchmark's opponent.

Shape key: B batch, T new tokens, S = past + T keys, E embedding, H heads,
D = E // H head dim, V vocabulary, C context length.

Written for this benchmark after *Build a Large Language Model (From
Scratch)*, chapter 4 (``GPTModel``, ``TransformerBlock``, ``LayerNorm``,
the tanh ``GELU``, ``FeedForward``; the attention of chapter 3), with the
book's module and parameter names, so that its ``state_dict`` is the one
:mod:`qkvnp.interop`'s layout ``"book.GPTModel"`` reads and writes. Decoding
follows the book's bonus KV-cache section: each attention layer keeps the
keys and values of the past tokens in buffers allocated once at the
context length (its "optimized" variant, the faster of the two), and the
new tokens' positions continue from the cached ones.

torch is imported by the caller and passed in (:func:`book_gpt`): importing
this module costs nothing.
"""
import math

__all__ = ["book_gpt", "generate_cached"]


def book_gpt(torch):
    """The book's ``GPTModel`` class, built on ``torch``.

    Returns
    -------
    type
        ``GPTModel(cfg)`` with the book's config keys (``vocab_size``,
        ``context_length``, ``emb_dim``, ``n_heads``, ``n_layers``,
        ``drop_rate``, ``qkv_bias``); ``model(idx)`` gives the logits
        ``(B, T, V)`` of a whole sequence (training), and
        ``model(idx, use_cache=True)`` those of new tokens after the cached
        ones (after ``model.reset_kv_cache()``).

    Examples
    --------
    With PyTorch installed (the harness imports it only where it measures)::

        import torch
        GPTModel = book_gpt(torch)
    """
    nn = torch.nn

    class MultiHeadAttention(nn.Module):
        def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
            super().__init__()
            self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
            self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.out_proj = nn.Linear(d_out, d_out)
            self.dropout = nn.Dropout(dropout)
            # True above the diagonal: the future a token may not see
            self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length),
                                                    diagonal=1))
            self.cache_k = self.cache_v = None
            self.filled = 0

        def reset_cache(self):
            self.cache_k = self.cache_v = None
            self.filled = 0

        def forward(self, x, use_cache=False):
            b, num_tokens, _ = x.shape

            def heads(y):
                return y.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

            queries = heads(self.W_query(x))  # (B, T, E) -> (B, H, T, D)
            keys, values = heads(self.W_key(x)), heads(self.W_value(x))
            past = 0
            if use_cache:
                if self.cache_k is None:
                    shape = (b, self.num_heads, self.mask.shape[0], self.head_dim)
                    self.cache_k = torch.empty(shape, dtype=x.dtype)  # (B, H, C, D)
                    self.cache_v = torch.empty(shape, dtype=x.dtype)
                past = self.filled
                self.cache_k[:, :, past:past + num_tokens] = keys
                self.cache_v[:, :, past:past + num_tokens] = values
                self.filled = past + num_tokens
                keys = self.cache_k[:, :, :self.filled]  # (B, H, S, D)
                values = self.cache_v[:, :, :self.filled]
            scores = queries @ keys.transpose(2, 3)  # (B, H, T, S)
            # NOTE: the new tokens are rows past..past+T-1 of the causal mask
            future = self.mask.bool()[past:past + num_tokens, :past + num_tokens]
            scores.masked_fill_(future, -torch.inf)
            weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
            weights = self.dropout(weights)
            context = (weights @ values).transpose(1, 2)  # (B, H, T, D) -> (B, T, H, D)
            context = context.contiguous().view(b, num_tokens, self.d_out)  # -> (B, T, E)
            return self.out_proj(context)

    class LayerNorm(nn.Module):
        def __init__(self, emb_dim):
            super().__init__()
            self.eps = 1e-5
            self.scale = nn.Parameter(torch.ones(emb_dim))
            self.shift = nn.Parameter(torch.zeros(emb_dim))

        def forward(self, x):
            mean = x.mean(dim=-1, keepdim=True)
            var = x.var(dim=-1, keepdim=True, unbiased=False)
            norm_x = (x - mean) / torch.sqrt(var + self.eps)
            return self.scale * norm_x + self.shift

    class GELU(nn.Module):
        def forward(self, x):
            # the tanh approximation, the book's and GPT-2's
            return 0.5 * x * (1 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))

    class FeedForward(nn.Module):
        def __init__(self, emb_dim):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(emb_dim, 4 * emb_dim), GELU(),
                                        nn.Linear(4 * emb_dim, emb_dim))

        def forward(self, x):
            return self.layers(x)

    class TransformerBlock(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.att = MultiHeadAttention(cfg["emb_dim"], cfg["emb_dim"], cfg["context_length"],
                                          cfg["drop_rate"], cfg["n_heads"], cfg["qkv_bias"])
            self.ff = FeedForward(cfg["emb_dim"])
            self.norm1 = LayerNorm(cfg["emb_dim"])
            self.norm2 = LayerNorm(cfg["emb_dim"])
            self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

        def forward(self, x, use_cache=False):
            x = x + self.drop_shortcut(self.att(self.norm1(x), use_cache=use_cache))
            return x + self.drop_shortcut(self.ff(self.norm2(x)))

    class GPTModel(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
            self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
            self.drop_emb = nn.Dropout(cfg["drop_rate"])
            self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
            self.final_norm = LayerNorm(cfg["emb_dim"])
            self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)
            self.position = 0  # of the next token decoded with the cache

        def reset_kv_cache(self):
            for block in self.trf_blocks:
                block.att.reset_cache()
            self.position = 0

        def forward(self, in_idx, use_cache=False):
            seq_len = in_idx.shape[1]
            start = self.position if use_cache else 0
            if start + seq_len > self.pos_emb.num_embeddings:
                raise ValueError(f"positions {start}..{start + seq_len - 1} exceed the context "
                                 f"length {self.pos_emb.num_embeddings}")
            positions = torch.arange(start, start + seq_len)
            x = self.drop_emb(self.tok_emb(in_idx) + self.pos_emb(positions))  # (B, T, E)
            for block in self.trf_blocks:
                x = block(x, use_cache=use_cache)
            if use_cache:
                self.position = start + seq_len
            return self.out_head(self.final_norm(x))  # (B, T, E) -> (B, T, V)

    return GPTModel


def generate_cached(torch, model, idx, max_new_tokens):
    """Greedy decoding with the KV cache, as the book's ``generate_text_simple_cached``.

    The prompt is fed once, then each chosen token alone. Unlike the book's
    loop it stops after choosing the last token instead of feeding it too
    (what ``qkvnp.generate`` does): ``max_new_tokens`` forwards in all.

    Parameters
    ----------
    idx : torch.Tensor of int64, shape (B, T)
        The prompt; ``T + max_new_tokens`` must fit the context.

    Returns
    -------
    torch.Tensor, shape (B, T + max_new_tokens)
    """
    with torch.inference_mode():
        model.reset_kv_cache()
        pending = idx
        for _ in range(max_new_tokens):
            logits = model(pending, use_cache=True)[:, -1]  # (B, V)
            pending = logits.argmax(dim=-1, keepdim=True)  # (B, 1) first maximum
            idx = torch.cat([idx, pending], dim=1)  # (B, T) -> (B, T + 1)
    return idx
