"""Prefect tasks: thin, typed wrappers, each around one grpo_core stage.

They exchange storage URIs, config hashes and floats, never arrays. The pipeline issue adds
prepare_dataset, check_readiness, train_epoch and evaluate here.
"""
