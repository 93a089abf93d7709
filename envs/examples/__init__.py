"""Small example environments, plugged in by import path (see docs/envs.md)."""
