"""`make bench`: hpctrain's scaling numbers against raw Horovod and mpi4py baselines.

benchmarks/run.py is the entry point; sections/ holds one module per report section,
baselines/ the hand-written comparison scripts, workers/ what runs inside mpirun ranks.
"""
