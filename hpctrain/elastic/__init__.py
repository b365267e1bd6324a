"""Elastic restart: `hpctrain elastic` supervises an mpirun job and restarts it from its
newest verified checkpoint on the hosts that still answer, within a world-size range and
a restart budget (the honest contract on a static MPI cluster; Horovod elastic needs
Gloo, torchrun's agent needs its own rendezvous)."""
