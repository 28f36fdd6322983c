"""Staging between the PFS and node-local burst buffers: walk, plan, copy, pack, verify."""
