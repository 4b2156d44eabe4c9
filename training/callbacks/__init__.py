"""Callbacks every normlab run attaches: RNG-state checkpointing and throughput/MFU logging."""
from training.callbacks.rng import RNGState
from training.callbacks.throughput import Throughput

__all__ = ["RNGState", "Throughput"]
