"""Thin adapters to training frameworks; import the submodule you need (``integrations.ddp``)."""
