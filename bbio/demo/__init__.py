"""The demo: ``python -m bbio.demo`` drives the MPI job of :mod:`bbio.demo.job` in phases."""
