"""Callbacks every normlab run attaches: crash-safe step checkpoints, RNG-state checkpointing, throughput/MFU,
training-health metrics and the non-finite guard."""
from training.callbacks.guard import NonFiniteGuard
from training.callbacks.health import TrainingHealth
from training.callbacks.rng import RNGState
from training.callbacks.step_checkpoint import StepCheckpoint
from training.callbacks.throughput import Throughput

__all__ = ["NonFiniteGuard", "RNGState", "StepCheckpoint", "Throughput", "TrainingHealth"]
