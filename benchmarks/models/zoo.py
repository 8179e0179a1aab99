"""Real architectures of Hugging Face transformers, in small random configurations.

Nothing is downloaded. Every dropout probability is 0, so that a pipeline
over micro-batches must give the unwrapped model's output and gradients.
Each entry says how a user flattens the model: with no argument when it
gives ``dummy_inputs`` fit for its forward (the text models), with an
example of its input otherwise (the vision models, whose ``dummy_inputs``
are token ids). Used by ``tests/capture/test_models.py`` and
``python -m benchmarks.any_model``; needs transformers.
"""
from typing import Any, Callable, Dict, NamedTuple, Optional

import torch
import transformers
from torch import Tensor, nn

__all__ = ['MODELS', 'Case']

V, B, T = 100, 8, 12  # vocabulary, batch, sequence length
IMAGE = (3, 32, 32)

Factory = Callable[[], nn.Module]


def tokens() -> Dict[str, Tensor]:
    return {'input_ids': torch.randint(0, V, (B, T))}


def tokens_with_mask() -> Dict[str, Tensor]:
    mask = torch.ones(B, T, dtype=torch.long)
    mask[::2, -3:] = 0  # padding at the end of every other sequence
    return {**tokens(), 'attention_mask': mask}


def images() -> Dict[str, Tensor]:
    return {'pixel_values': torch.randn(B, *IMAGE, dtype=torch.float64)}


def logits(output: Any) -> Tensor:
    return output.logits  # type: ignore[no-any-return]


def hidden(output: Any) -> Tensor:
    return output.last_hidden_state  # type: ignore[no-any-return]


class Case(NamedTuple):
    """A model to flatten, and how to check it."""

    factory: Factory
    #: a batch of inputs, by argument name
    inputs: Callable[[], Dict[str, Tensor]]
    #: the tensor of the output a loss is computed from
    select: Callable[[Any], Tensor]
    #: the example to_sequential is given; None: no argument
    example: Optional[Callable[[], Dict[str, Tensor]]]
    #: compared in evaluation mode (batch normalization)
    evaluate: bool


MODELS: Dict[str, Case] = {
    'gpt2': Case(lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), tokens, logits, None, False),
    'llama': Case(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=V, max_position_embeddings=64)),
        tokens, logits, None, False),
    'opt': Case(lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, ffn_dim=64, vocab_size=V,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
        attention_dropout=0.0)), tokens, logits, None, False),
    'bert': Case(lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=V, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        tokens, logits, None, False),
    'bert-with-mask': Case(lambda: transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=V, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        tokens_with_mask, hidden, tokens_with_mask, False),
    'distilbert': Case(lambda: transformers.DistilBertForMaskedLM(
        transformers.DistilBertConfig(n_layers=2, dim=32, n_heads=2, hidden_dim=64,
                                      vocab_size=V, dropout=0.0, attention_dropout=0.0)),
        tokens, logits, None, False),
    't5-encoder': Case(lambda: transformers.T5EncoderModel(transformers.T5Config(
        num_layers=2, d_model=32, d_kv=8, num_heads=2, d_ff=64, vocab_size=V,
        dropout_rate=0.0)), tokens, hidden, None, False),
    'vit': Case(lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)), images, logits, images, False),
    'convnext': Case(lambda: transformers.ConvNextForImageClassification(
        transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                    image_size=32, num_labels=5)),
        images, logits, images, False),
    # Batch normalization normalizes each micro-batch by its own statistics
    # in training: the model is compared in evaluation mode.
    'resnet': Case(lambda: transformers.ResNetForImageClassification(
        transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                  num_labels=5)),
        images, logits, images, True),
}


