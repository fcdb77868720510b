"""The public surface stays where it is: every name of ``__all__`` of the public modules.

Oracle: the names those modules exported when the package was laid out in
tier folders (written out below). A name may be added (add it here too);
removing or moving one breaks the users who import it, so it fails here
first, and the CHANGELOG must say where it went.
"""
import importlib

import pytest

PUBLIC = {
    "qkvnp": [
        "Decoder", "DecoderConfig", "Dropout", "Embedding", "FeedForward", "GELU", "GPTModel",
        "GatedFeedForward",
        "KVCache", "LayerNorm", "Linear", "Model", "MultiHeadAttention", "RMSNorm",
        "SelfAttention", "Sequential", "SiLU", "TransformerBlock", "__version__", "functional",
        "generate", "get_num_threads", "interop", "num_threads", "positions",
        "scaled_dot_product_attention", "set_num_threads", "softmax", "variants",
    ],
    "qkvnp.functional": [
        "ActivationDropoutCache", "AttentionCache", "EmbeddingCache", "GatedMLPCache",
        "GeluCache", "HeadsCache", "LayerNormCache", "LinearCache", "LoadBalancingLossCache",
        "RMSNormCache", "ResidualCache", "RouterCache", "SiluCache", "SoftmaxCache",
        "activation_dropout_backward", "activation_dropout_forward", "attention_backward",
        "attention_forward", "column_sums", "dropped_weights", "embedding_backward",
        "embedding_backward_factored", "embedding_forward", "gated_mlp_backward",
        "gated_mlp_forward", "gelu_backward", "gelu_forward", "layer_norm_backward",
        "layer_norm_forward", "linear_backward", "linear_forward",
        "load_balancing_loss_backward", "load_balancing_loss_forward", "merge_heads_backward",
        "merge_heads_forward", "residual_add_backward", "residual_add_forward",
        "rms_norm_backward", "rms_norm_forward", "rope_backward", "rope_forward",
        "router_backward", "router_forward", "scaled_dot_product_attention", "silu_backward",
        "silu_forward", "softmax", "softmax_backward", "softmax_forward",
        "split_heads_backward", "split_heads_forward", "sum_to_shape",
    ],
    "qkvnp.layers": [
        "DecoderAttention", "DecoderBlock", "Dropout", "Embedding", "FeedForward", "GELU",
        "GatedFeedForward", "Layer",
        "LayerNorm", "Linear", "LoadResult", "MoEFeedForward", "Model", "MultiHeadAttention",
        "RMSNorm", "SelfAttention", "Sequential", "SiLU", "TransformerBlock", "xavier_uniform",
    ],
    "qkvnp.kernels": [
        "BLOCK_SIZE_DEFAULTS", "Dispatch", "IMPLS", "MAX_NUM_THREADS", "PATH_TOLERANCES",
        "TILED_VARIANTS", "blas_threads", "block_sizes", "buffer_owner", "check_impl",
        "choose_decode_path", "choose_path", "choose_train_path", "get_block_sizes", "get_num_threads", "held_buffer_bytes",
        "num_threads", "release_buffers", "set_block_sizes", "set_num_threads",
    ],
    "qkvnp.gradcheck": [
        "DIAGNOSES", "GradcheckError", "GradcheckReport", "GradcheckRow", "METHODS", "MODES",
        "ORACLE_EPS", "ORDERS", "SWEEP_EPS", "SymmetryReport", "TOLERANCES", "Tolerance",
        "check_function", "check_layer", "check_op", "check_symmetry_function",
        "check_symmetry_layer", "check_symmetry_op", "sweep_eps", "sweep_steps",
    ],
    "qkvnp.interop": [
        "HF_ARCHITECTURES", "LAYOUTS", "SafetensorsError", "SafetensorsFile", "from_hf",
        "from_torch", "load_safetensors", "save_hf", "save_safetensors", "to_hf", "to_torch",
    ],
    "qkvnp.optim": [
        "Adam", "AdamW", "Optimizer", "SGD",
    ],
    "qkvnp.losses": [
        "CrossEntropyCache", "MSECache", "accuracy", "cross_entropy_backward",
        "cross_entropy_forward", "mse_backward", "mse_forward",
    ],
    "qkvnp.training": [
        "AttentionRegressor", "CheckpointError", "KVRecallModel", "KVRecallTask",
        "PartnerTask", "TASKS", "TeacherTask", "TrainConfig", "TrainResult", "VARIANTS",
        "load_checkpoint", "make_streams", "save_checkpoint", "train",
    ],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_every_public_name_imports_from_where_it_did(module_name):
    module = importlib.import_module(module_name)
    missing = [name for name in PUBLIC[module_name] if not hasattr(module, name)]
    assert missing == [], f"{module_name} no longer has {missing}"
    assert set(PUBLIC[module_name]) <= set(module.__all__), module_name
