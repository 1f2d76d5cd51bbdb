"""Layouts in auto and manual mode against the single-device run: losses, gradients, parameters."""
