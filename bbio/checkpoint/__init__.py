"""Checkpoints: collective HDF5 into the burst buffer, a drain process to the PFS, restore."""
