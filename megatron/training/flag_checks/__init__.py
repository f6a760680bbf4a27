"""Checks of flag combinations, by subject; ``megatron.training.arguments`` runs them."""
