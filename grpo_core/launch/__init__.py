"""Starting worker processes: here, as several local processes, on a Ray cluster or a TPU VM slice,
and the multi-host environment they share. JAX-free."""
