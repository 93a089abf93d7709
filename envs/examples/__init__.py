"""Small example environments, plugged in by import path (see the README)."""
