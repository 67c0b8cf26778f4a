"""Reference models in plain PyTorch: what the examples, tests, benchmarks and plans run.

* :mod:`~autoshard.models.llama` -- causal LM: RoPE from arange positions, RMSNorm, GQA attention
  through ``scaled_dot_product_attention(is_causal=True)``, SwiGLU, tied LM head, shifted-label loss;
* :mod:`~autoshard.models.bert` -- encoder classifier: padding mask from ``attention_mask``, learned
  positions, LayerNorm, masked mean pooling over the sequence;
* :mod:`~autoshard.models.vit` -- vision encoder: convolutional patches, a CLS token prepended (odd
  length), a full learned positional parameter, CLS readout;
* :mod:`~autoshard.models.handwritten` -- causal LM whose attention is written out
  (``matmul -> scale -> masked_fill -> softmax -> matmul``).

Nothing here knows about autoshard: they are the models a user would write.
"""

from .bert import BertClassifier, BertConfig
from .handwritten import HandwrittenConfig, HandwrittenLM
from .llama import LlamaConfig, LlamaLM
from .vit import ViTClassifier, ViTConfig

__all__ = ["LlamaLM", "LlamaConfig", "BertClassifier", "BertConfig", "ViTClassifier", "ViTConfig",
           "HandwrittenLM", "HandwrittenConfig"]
