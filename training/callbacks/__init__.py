"""Callbacks every normlab run attaches: RNG-state checkpointing, throughput/MFU and training-health metrics."""
from training.callbacks.health import TrainingHealth
from training.callbacks.rng import RNGState
from training.callbacks.throughput import Throughput

__all__ = ["RNGState", "Throughput", "TrainingHealth"]
