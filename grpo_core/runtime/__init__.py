"""Devices: the mesh and the shardings of parameters and batches. Needs JAX."""
