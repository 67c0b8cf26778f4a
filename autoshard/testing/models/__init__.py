"""Reference models in plain PyTorch that the examples, tests, benchmarks and plans run: test models, not a
model zoo (a user brings their own model, or transformers' unmodified).

* :mod:`~autoshard.testing.models.llama` -- causal LM: RoPE from arange positions, RMSNorm, GQA attention
  through ``scaled_dot_product_attention(is_causal=True)``, SwiGLU, tied LM head, shifted-label loss;
* :mod:`~autoshard.testing.models.bert` -- encoder classifier: padding mask from ``attention_mask``, learned
  positions, LayerNorm, masked mean pooling over the sequence;
* :mod:`~autoshard.testing.models.vit` -- vision encoder: convolutional patches, a CLS token prepended (odd
  length), a full learned positional parameter, CLS readout;
* :mod:`~autoshard.testing.models.handwritten` -- causal LM whose attention is written out
  (``matmul -> scale -> masked_fill -> softmax -> matmul``).

Their configurations derive from :class:`~autoshard.testing.models.base.TransformerConfig` (the widths and counts
every one has), and BERT's, ViT's and the handwritten LM's layers from
:class:`~autoshard.testing.models.base.GeluLayer` (LayerNorms and a GELU feed-forward around each one's attention).

Nothing here knows about autoshard: they are the models a user would write.
"""

from .bert import BertClassifier, BertConfig
from .handwritten import HandwrittenConfig, HandwrittenLM
from .llama import LlamaConfig, LlamaLM
from .vit import ViTClassifier, ViTConfig

__all__ = ["LlamaLM", "LlamaConfig", "BertClassifier", "BertConfig", "ViTClassifier", "ViTConfig",
           "HandwrittenLM", "HandwrittenConfig"]
