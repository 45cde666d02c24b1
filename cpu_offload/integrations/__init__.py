"""Integrations with training frameworks; each module imports its framework itself (none is a
runtime dependency): ``cpu_offload.integrations.transformers`` for the Hugging Face ``Trainer``."""
