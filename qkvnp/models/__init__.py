"""The models built from the layers: the book's GPT and its generation loop.

==================  ===========================================================
``gpt``             :class:`~qkvnp.GPTModel`, the book's chapter 4 GPT
``generation``      :func:`~qkvnp.generate`, its KV-cached sampling loop
``decoder``         :class:`~qkvnp.Decoder`, one decoder for GPT-2, Llama 3,
                    Qwen3, Qwen3-MoE, Gemma 3, Mistral
``decoder_config``  :class:`~qkvnp.DecoderConfig` and the families' presets
==================  ===========================================================
"""

__all__: list = []
