"""Attention backends over the paged latent pool (base.py states the interface and its invariants)."""
from model.attention.base import BACKENDS, AttentionBackend, Absorbed, make_backend

__all__ = ["BACKENDS", "Absorbed", "AttentionBackend", "make_backend"]
