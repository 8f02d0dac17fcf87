"""Gymnasium environments for MoE-RL (gymnasium + numpy only). Importing registers them."""
