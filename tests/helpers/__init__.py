"""Shared test helpers: running normlab in real (multi-)process setups on CPU, reading back what it wrote."""
