"""The run root (local folder, gs:// or memory://): its layout, reports and where checkpoints come from. JAX-free."""
