"""Pipeline parallelism, framework-free: stage partitioning, schedules and transport.

The runner lives in hpctrain/strategies/pipeline.py; the framework code of a stage in
hpctrain/backends/torch_stage.py and tensorflow_stage.py.
"""
