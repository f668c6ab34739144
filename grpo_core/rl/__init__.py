"""GRPO itself: the objective (algo), log-probs, the sampler, the learner, the trainer loop,
evaluation and checkpoints. Needs JAX."""
