"""The overlap lab (`coc-inject lab`, docs/lab.md): a parallel group of N emulated in one process on
one device. ``links`` times a collective as an interconnect would, ``streams`` is where it runs (a
thread on the CPU, a side stream on CUDA), ``outputs`` what it writes (as if every rank held this
rank's data), ``backend`` the process group Megatron and coc-inject call, ``store`` the rendezvous
store that answers for the absent ranks, ``world`` starts and stops it all, ``shapes`` the models'
per-rank shapes, ``steps`` one model's training step off and on, ``command`` the command line."""
