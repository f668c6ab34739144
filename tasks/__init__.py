"""Prefect tasks: thin, typed wrappers, each around one grpo_core stage (tasks/stages.py), and
the worker-process plumbing they share (tasks/process.py), and the readiness report that
`grpo check` builds without Prefect (tasks/readiness.py).

They exchange storage URIs, config hashes and floats, never arrays.
"""
