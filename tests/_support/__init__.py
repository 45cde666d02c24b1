"""Helpers shared by the test files: models and checks for both backends (``parity_models``),
the torch.distributed cases run under torchrun (``distributed_cases``)."""
