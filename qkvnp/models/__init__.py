"""The models built from the layers: the book's GPT and its generation loop.

==================  ===========================================================
``gpt``             :class:`~qkvnp.GPTModel`, the book's chapter 4 GPT
``generation``      :func:`~qkvnp.generate`, its KV-cached sampling loop
==================  ===========================================================
"""

__all__: list = []
