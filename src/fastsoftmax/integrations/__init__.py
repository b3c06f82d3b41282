"""Integrations with other libraries, each an optional extra that the core never imports.

- ``fastsoftmax.integrations.transformers`` (``pip install "fastsoftmax[hf]"``): one call puts the library's
  LM-head loss, and on request its softmax in attention, into a Hugging Face causal LM.
"""
