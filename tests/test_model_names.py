"""The one parser of a parameter's block index, against the model's own module tree."""
from model import ModelConfig, Transformer
from model.names import layer_index, split_layer


def test_layer_index_of_every_parameter():
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=16, qk_norm="head"))
    expected = {f"layers.{i}.{name}": i for i, block in enumerate(model.layers) for name, _ in block.named_parameters()}
    for name, _ in model.named_parameters():
        assert layer_index(name) == expected.get(name), name
    assert split_layer("model.layers.12.self_attn.q_proj.weight") == ("model.layers.", 12, "self_attn.q_proj.weight")
    assert split_layer("norm.weight") is None and layer_index("layers_norm.weight") is None
