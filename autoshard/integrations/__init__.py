"""Integrations with training frameworks that own the loop: :mod:`.transformers` (``Trainer``, TRL's ``SFTTrainer``).

Each is imported on its own (``import autoshard.integrations.transformers``), so autoshard never imports a framework
a user does not use."""
