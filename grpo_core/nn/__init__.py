"""The model in Flax NNX: the decoder, LoRA adapters, Hugging Face weights in and out. Needs JAX."""
