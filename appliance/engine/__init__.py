"""Paged-KV continuous-batching inference engine.

`sequence`, `block_manager`, `scheduler`, `sampling_params`, `outputs` and `engine_settings` are
pure Python (no torch); the runner, sampler and models sit on top of them. The engine never
imports the web layers.
"""
